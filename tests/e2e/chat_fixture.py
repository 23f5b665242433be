"""A tiny HF checkpoint with a real tokenizer and chat template, for chat and stop-string tests.

- tokenizer: byte-level BPE (as Qwen's) trained with the `tokenizers` library on a small corpus to exactly
  the model's 512 ids; multi-byte characters (é, 中, emoji) are split across byte tokens; special tokens
  `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (EOS); a ChatML Jinja template with Qwen3's
  `enable_thinking` switch and a `raise_exception` for a conversation that opens with an assistant turn;
- model: transformers `Qwen3ForCausalLM` (the qwen3-tiny shape) in fp32, random weights with the LM head rows
  of printable multi-character ASCII tokens scaled up, so that greedy text is readable (and its stop strings
  easy to pick); `save_pretrained`.
"""
from __future__ import annotations

from pathlib import Path

VOCAB_SIZE = 512
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.",
    "Graph capture turns many small kernel launches into one replay of a recorded graph.",
    "A scheduler admits waiting requests, decodes running ones and preempts the newest under pressure.",
    "Stop strings end a completion when the generated text contains them; the match is not returned.",
    "Tokens stream to the client as server-sent events, one chunk per step or per group of steps.",
    "Café, naïve, résumé: accents are two bytes in UTF-8; 中文字符 are three; emoji 🙂🚀 are four.",
    "system user assistant hello world answer question think reason because therefore however",
    "one two three four five six seven eight nine ten eleven twelve hundred thousand million",
]
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'assistant' %}"
    "{{ raise_exception('the conversation must not open with an assistant message') }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def build_tokenizer():
    """A transformers `PreTrainedTokenizerFast` (byte-level BPE, 512 ids, chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_checkpoint(directory: Path, seed: int = 7) -> Path:
    """Write the checkpoint (config, fp32 safetensors, tokenizer files with the template) into `directory`."""
    import torch
    import transformers

    from modeling.config import get_preset

    directory.mkdir(parents=True, exist_ok=True)
    cfg = get_preset("qwen3-tiny").to_hf_dict()
    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in cfg.items() if k != "architectures"})
    tok = build_tokenizer()
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(hf_cfg).float()
    scale = torch.full((hf_cfg.vocab_size, 1), 0.25)
    for i in range(hf_cfg.vocab_size):
        s = tok.decode([i])
        if s.isascii() and s.isprintable() and len(s.strip()) >= 2 and i not in tok.all_special_ids:
            scale[i] = 4.0
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory
