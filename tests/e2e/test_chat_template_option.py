"""`graphline serve --chat-template` (vLLM's option): a template from a file or given inline replaces the
checkpoint's for chat completions and `/tokenize` (the fixture checkpoint: a real byte-level BPE tokenizer, random
weights); a template that does not render, or a model without a tokenizer, stops the server at start-up with a
message naming the option."""
from __future__ import annotations

import subprocess

import pytest

from e2e_support import REPO, TINY_ARGS, clean_env, graphline, http_json, openai_client, serve_checkpoint
from tests.fixtures.hf_checkpoints import build_checkpoint

transformers = pytest.importorskip("transformers")

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
MSGS = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("chat-template") / "tiny-chat")


@pytest.mark.parametrize("inline", [False, True])
def test_the_template_replaces_the_checkpoints(ckpt, tmp_path, inline):
    tok = transformers.AutoTokenizer.from_pretrained(str(ckpt), local_files_only=True)
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    srv = serve_checkpoint(ckpt, "--chat-template", TEMPLATE if inline else str(path))
    try:
        want = tok.encode("[system] be terse\n[user] hello there\n[assistant]")
        status, body = http_json(srv.url + "/tokenize", body={"messages": MSGS})
        assert status == 200 and body["tokens"] == want
        assert want != tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True, return_dict=False)
        chat = openai_client(srv).chat.completions.create(model="tiny-chat", messages=MSGS, max_tokens=2)
        assert chat.usage.prompt_tokens == len(want)
    finally:
        srv.stop()


@pytest.mark.parametrize("model, value, says", [
    ("ckpt", "{% for m in messages %}", "does not render"),
    ("ckpt", "/no/such/template.jinja", "neither a file nor a Jinja template"),
    ("tiny", TEMPLATE, "needs a tokenizer"),
])
def test_a_bad_template_stops_the_server_at_start_up(ckpt, model, value, says):
    args = ["--model", str(ckpt), "--executor", "local", "--device", "cpu", "--no-progress"] if model == "ckpt" \
        else [*TINY_ARGS, "--executor", "local"]
    p = subprocess.run(graphline("serve", *args, "--port", "0", "--chat-template", value), cwd=REPO,
                       env=clean_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "--chat-template" in p.stderr + p.stdout and says in p.stderr + p.stdout
