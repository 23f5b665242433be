"""Command-line options shared by `serve`, `generate` and `bench`, and what they build:
the `RuntimeConfig` of every rank, the deployment (Ray coordinator or local executor),
and the engine configuration. The `GRAPHLINE_*` variables become typed option objects here, once, on the
driver (`actors.environment.options_from_environ`), and travel inside the configs to every rank."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional, Sequence

EXECUTORS = ("ray", "local", "auto")


def add_model_args(p: argparse.ArgumentParser, executor_default: str = "ray") -> None:
    g = p.add_argument_group("model and deployment")
    g.add_argument("--model", default="qwen3-tiny", help="HF checkpoint directory (config.json + safetensors) "
                   "or a random-weight preset: qwen3-tiny, qwen3-moe-tiny, qwen3-0.6b, qwen3-moe-small, "
                   "qwen3-moe-2048 (bf16, hidden 2048: DeepEP)")
    g.add_argument("--seed", type=int, default=0, help="weight seed of a preset")
    g.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None)
    g.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda (each rank its own GPU), "
                   "or cuda:N (--executor local only)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per DP group")
    g.add_argument("--dp", type=int, default=1, help="data-parallel groups (one scheduler each)")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (MoE; = world size when enabled)")
    g.add_argument("--ep-backend", choices=("allgather", "deepep"), default="allgather")
    g.add_argument("--address", default=None, help="an existing Ray cluster (e.g. HEAD_IP:6379); default: start one")
    g.add_argument("--num-cpus", type=int, default=None, help="CPUs of a Ray cluster started here")
    g.add_argument("--ray-listen", choices=("loopback", "node"), default="loopback",
                   help="where a Ray cluster started here (no --address) listens: loopback (default: no other "
                        "machine can reach it) or the node's address")
    g.add_argument("--executor", choices=EXECUTORS, default=executor_default,
                   help="ray: the Ray coordinator (one actor per rank); local: one rank in this process, no Ray; "
                        "auto: local for one rank without --address, else ray")
    g.add_argument("--step-timeout-s", type=float, default=30.0)
    g.add_argument("--collective-timeout-s", type=float, default=60.0)
    c = p.add_argument_group("KV cache and scheduling")
    c.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default 64, 16 on CPU)")
    c.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per rank (default: from free memory)")
    c.add_argument("--kv-cache-memory-fraction", type=float, default=0.5)
    c.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence (prompt + output); default: the model's max_position_embeddings, at most "
                        "4096")
    c.add_argument("--max-num-seqs", type=int, default=None, help="running sequences per DP rank "
                   "(default: --max-decode-batch, so every decode batch has a graph)")
    c.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="which waiting request is admitted first: fcfs (arrival order) or priority (a request's "
                        "'priority', lower first, then arrival order; a waiting request with a lower value than a "
                        "running one that cannot be admitted preempts it; requests may set it only under this "
                        "policy)")
    c.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step per DP rank: decode rows plus prefill chunks (default 2048 on "
                        "GPUs, 512 on CPU, at most --pcg-max-tokens so mixed steps replay a captured plan); a budget "
                        ">= --max-model-len never splits a prompt")
    c.add_argument("--no-chunked-prefill", action="store_true",
                   help="prefill whole prompts in steps of their own (no decode rows alongside) instead of splitting "
                        "them into chunks that share steps with decoding requests")
    c.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse the KV blocks of earlier prompts with the same prefix (automatic prefix caching)")
    c.add_argument("--overlap", action="store_true",
                   help="schedule and submit the next decode round while the current one runs (lower time per "
                        "output token at low concurrency; see docs/benchmarks.md for its tail-latency caveat)")
    c.add_argument("--overlap-max-seqs", type=int, default=32,
                   help="with --overlap: only for decode rounds of at most this many sequences")
    c.add_argument("--decode-steps", type=int, default=1,
                   help="multi-step decode: decode steps per scheduling round while no running request needs "
                        "sampler extras (logprobs, penalties, bias) (tokens stream in groups of this size; host overhead is paid once per group)")
    r = p.add_argument_group("graph runner")
    r.add_argument("--eager", action="store_true", help="never capture CUDA graphs")
    r.add_argument("--max-decode-batch", type=int, default=None,
                   help="largest decode batch with a full graph, 0 = off (default 256; 16 on CPU, where start-up "
                        "only warms the buckets up eagerly)")
    r.add_argument("--pcg-max-tokens", type=int, default=None,
                   help="largest piecewise prefill bucket, 0 = off (default 4096; 512 on CPU)")
    r.add_argument("--pcg-token-stride", type=int, default=512)
    r.add_argument("--pcg-min-tokens", type=int, default=None, help="finer power-of-two prefill buckets from here")
    r.add_argument("--prefill-graph-max-tokens", type=int, default=None,
                   help="largest token bucket of the full prefill graphs (a whole prefill step of up to this many "
                        "tokens as one CUDA graph), 0 = off (default 2048 on GPUs, at most --max-model-len; off on "
                        "CPU)")
    r.add_argument("--prefill-graph-max-seqs", type=int, default=4,
                   help="most sequences a step served by a full prefill graph may hold")
    r.add_argument("--armed-decode-wait-ms", type=float, default=20.0,
                   help="a rank with TP and EP size 1 enqueues its next greedy decode step behind a gate while it "
                        "waits for the request, for up to this long (0 = never; see actors/armed.py)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar during start-up capture")


def _on_cpu(args: argparse.Namespace) -> bool:
    if args.device == "cpu":
        return True
    if args.device == "auto":
        import torch

        return not torch.cuda.is_available()
    return False


DEFAULT_MAX_MODEL_LEN = 4096


def resolve_max_model_len(args: argparse.Namespace) -> None:
    """`--max-model-len` left unset: the model's `max_position_embeddings`, at most 4096. One set above the model's
    positions (its rotary tables end there) is a LaunchError naming both."""
    if getattr(args, "_max_model_len_resolved", False):
        return
    from modeling.config import PRESETS, get_preset, load_config

    try:
        cfg = get_preset(args.model) if args.model in PRESETS else load_config(args.model)
    except Exception:  # noqa: BLE001 - a bad --model is reported where the deployment is built
        cfg = None
    limit = cfg.max_position_embeddings if cfg is not None else None
    if args.max_model_len is None:
        args.max_model_len = min(DEFAULT_MAX_MODEL_LEN, limit) if limit else DEFAULT_MAX_MODEL_LEN
    elif limit and args.max_model_len > limit:
        raise LaunchError(f"--max-model-len {args.max_model_len} exceeds the model's max_position_embeddings "
                          f"({limit}); use at most {limit}")
    args._max_model_len_resolved = True


PREFILL_GRAPH_MAX_TOKENS = 2048  # default largest full prefill graph bucket on GPUs (the GPU step budget)


def resolve_graph_defaults(args: argparse.Namespace) -> None:
    """Fill graph options left unset: GPU-sized by default, small on CPU (eager warm-up of every bucket)."""
    resolve_max_model_len(args)
    cpu = _on_cpu(args)
    if args.max_decode_batch is None:
        args.max_decode_batch = 16 if cpu else 256
    if args.pcg_max_tokens is None:
        args.pcg_max_tokens = min(512 if cpu else 4096, args.max_model_len)
    elif args.pcg_max_tokens > args.max_model_len:
        raise LaunchError(f"--pcg-max-tokens {args.pcg_max_tokens} exceeds --max-model-len {args.max_model_len} "
                          "(the start-up prefill of the largest bucket is one sequence)")
    if args.prefill_graph_max_tokens is None:
        args.prefill_graph_max_tokens = 0 if cpu or args.eager else min(PREFILL_GRAPH_MAX_TOKENS, args.max_model_len)
    elif args.prefill_graph_max_tokens < 0 or args.prefill_graph_max_tokens > args.max_model_len:
        raise LaunchError(f"--prefill-graph-max-tokens {args.prefill_graph_max_tokens} must be in 0..--max-model-len "
                          f"({args.max_model_len}): the start-up capture of the largest bucket is one sequence")
    if args.prefill_graph_max_seqs < 1:
        raise LaunchError(f"--prefill-graph-max-seqs must be >= 1, got {args.prefill_graph_max_seqs}")


def runtime_config(args: argparse.Namespace, kernels: Any = None):
    """The `RuntimeConfig` of every rank; `kernels` (None: from the environment, `options_from_environ`)."""
    from actors.rank import RuntimeConfig
    from graphrunner.config import GraphRunnerConfig

    if kernels is None:
        from actors.environment import options_from_environ

        kernels = options_from_environ().kernels
    resolve_graph_defaults(args)
    graph = GraphRunnerConfig(eager_mode=args.eager, max_decode_batch=args.max_decode_batch,
                              pcg_max_tokens=args.pcg_max_tokens or None, pcg_token_stride=args.pcg_token_stride,
                              pcg_min_tokens=args.pcg_min_tokens, prefill_graph_max_tokens=args.prefill_graph_max_tokens,
                              prefill_graph_max_seqs=args.prefill_graph_max_seqs)
    block = args.block_size or (16 if _on_cpu(args) else 64)
    return RuntimeConfig(model=args.model, seed=args.seed, dtype=args.dtype, device=args.device, block_size=block,
                         num_kv_blocks=args.num_kv_blocks, kv_cache_memory_fraction=args.kv_cache_memory_fraction,
                         max_model_len=args.max_model_len, graph=graph,
                         armed_decode_wait_ms=args.armed_decode_wait_ms, kernels=kernels)


def prepare_process(args: argparse.Namespace) -> None:
    """Process-wide settings a command needs before anything imports Ray: no usage reporting, and a Ray cluster
    this process starts itself binds to loopback unless `--ray-listen node` (Ray reads the variable at import)."""
    from actors.environment import prepare_ray_process

    prepare_ray_process(getattr(args, "address", None) is None and getattr(args, "ray_listen", "node") == "loopback")


def check_device(args: argparse.Namespace, kind: str) -> None:
    """`--device` is auto, cpu, cuda or cuda:N (one rank in this process only)."""
    dev = args.device
    if dev in ("auto", "cpu", "cuda"):
        return
    if dev.startswith("cuda:") and dev[5:].isdigit():
        if kind != "local":
            raise LaunchError(f"--device {dev}: each Ray rank uses its own GPU; use --device cuda (or auto)")
        return
    raise LaunchError(f"--device {dev!r}: use auto, cpu, cuda or cuda:N")


def executor_kind(args: argparse.Namespace) -> str:
    if args.executor != "auto":
        return args.executor
    return "local" if args.tp * args.dp * args.ep == 1 and args.address is None else "ray"


class LaunchError(RuntimeError):
    """The command line describes a deployment that cannot be built."""


def build_executor(args: argparse.Namespace) -> tuple[Any, str]:
    """Create (not start) the executor the arguments describe; returns (executor, kind). The options are read from
    the environment here, once (`actors.environment.options_from_environ`)."""
    from actors.environment import options_from_environ

    try:
        opts = options_from_environ()
        rt = runtime_config(args, opts.kernels)
    except (ValueError, KeyError) as exc:  # config validation names the bad option
        raise LaunchError(f"bad deployment options: {exc}") from exc
    kind = executor_kind(args)
    check_device(args, kind)
    if kind == "local":
        if args.tp * args.dp * args.ep != 1 or args.address:
            raise LaunchError("--executor local runs one rank in this process: drop --tp/--dp/--ep/--address "
                              "or use --executor ray")
        from engine.executor import LocalEngineExecutor

        return LocalEngineExecutor(rt), kind
    try:
        from actors.coordinator import Coordinator, DeploymentConfig
    except ImportError as exc:  # pragma: no cover - only while the coordinator is missing
        raise LaunchError(f"the Ray coordinator is unavailable ({exc}); use --executor local") from exc
    try:
        dep = DeploymentConfig(runtime=rt, tp=args.tp, dp=args.dp, ep=args.ep, ep_backend=args.ep_backend,
                               address=args.address, num_cpus=args.num_cpus,
                               collective_timeout_s=args.collective_timeout_s, step_timeout_s=args.step_timeout_s,
                               comm=opts.comm, driver=opts.driver)
    except (ValueError, KeyError) as exc:
        raise LaunchError(f"bad deployment options: {exc}") from exc
    return Coordinator(dep), kind


def start_executor(executor: Any, args: argparse.Namespace) -> dict:
    return dict(executor.start(progress=not args.no_progress) or {})


GPU_BATCHED_TOKENS, CPU_BATCHED_TOKENS = 2048, 512  # chunked-prefill step budgets (see --max-num-batched-tokens)


def default_batched_tokens(args: argparse.Namespace) -> int:
    """--max-num-batched-tokens, else 2048 on GPUs / 512 on CPU, capped by the largest piecewise bucket (a mixed
    step above it would run eagerly)."""
    if args.max_num_batched_tokens is not None:
        if args.max_num_batched_tokens < 1:
            raise LaunchError(f"--max-num-batched-tokens must be >= 1, got {args.max_num_batched_tokens}")
        return args.max_num_batched_tokens
    budget = CPU_BATCHED_TOKENS if _on_cpu(args) else GPU_BATCHED_TOKENS
    return min(budget, args.pcg_max_tokens) if args.pcg_max_tokens else budget


def engine_config(args: argparse.Namespace, eos_token_ids: Optional[Sequence[int]] = None):
    """The engine's configuration; `eos_token_ids`: where generation stops unless a request sets ignore_eos."""
    from engine.llm_engine import EngineConfig

    resolve_graph_defaults(args)
    seqs = args.max_num_seqs or (args.max_decode_batch if args.max_decode_batch > 0 else 256)
    if args.decode_steps < 1:
        raise SystemExit(f"--decode-steps must be >= 1, got {args.decode_steps}")
    chunked = not getattr(args, "no_chunked_prefill", False)
    return EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=default_batched_tokens(args) if chunked else
                        args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, decode_steps=args.decode_steps,
                        enable_chunked_prefill=chunked,
                        enable_prefix_caching=not getattr(args, "no_prefix_caching", False),
                        overlap=bool(getattr(args, "overlap", False)),
                        overlap_max_seqs=getattr(args, "overlap_max_seqs", 32),
                        scheduling_policy=getattr(args, "scheduling_policy", "fcfs"),
                        eos_token_ids=None if eos_token_ids is None else tuple(eos_token_ids))


def checkpoint_generation_defaults(model: str, model_config: Any) -> dict:
    """What requests that omit a field get from the checkpoint: `generation_config.json`'s sampling values (greedy
    when it says `do_sample: false`), its `max_new_tokens`, and `eos_token_id` (generation_config.json's, else
    config.json's). {} for a preset without EOS ids."""
    from modeling.generation_config import load_generation_config, stop_token_ids

    gen = load_generation_config(model, model_config.vocab_size) if Path(model).is_dir() else None
    out: dict[str, Any] = {}
    if gen is not None:
        for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(gen, key) is not None:
                out[key] = getattr(gen, key)
        if gen.do_sample is False:
            out["temperature"] = 0.0
        if gen.max_new_tokens is not None:
            out["max_tokens"] = gen.max_new_tokens
    eos = stop_token_ids(model_config, gen)
    if eos:
        out["eos_token_id"] = list(eos)
    return out


def served_model_name(args: argparse.Namespace) -> str:
    name = getattr(args, "served_model_name", None)
    if name:
        return name
    p = Path(args.model)
    return p.name if p.is_dir() else args.model


def load_tokenizer(model: str) -> Optional[Any]:
    """The checkpoint's tokenizer (transformers AutoTokenizer, local files only), or None."""
    p = Path(model)
    if not p.is_dir() or not any((p / f).exists() for f in ("tokenizer.json", "tokenizer_config.json",
                                                           "vocab.json", "tokenizer.model")):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - a broken tokenizer must not stop token-id serving
        print(f"graphline: no tokenizer loaded from {p}: {type(exc).__name__}: {exc}", flush=True)
        return None


def deployment_summary(args: argparse.Namespace, kind: str) -> dict:
    return {"executor": kind, "model": args.model, "tp": args.tp, "dp": args.dp, "ep": args.ep,
            "ep_backend": args.ep_backend, "address": args.address, "device": args.device, "eager": args.eager,
            "max_decode_batch": args.max_decode_batch, "pcg_max_tokens": args.pcg_max_tokens,
            "pcg_token_stride": args.pcg_token_stride,
            "prefill_graph_max_tokens": args.prefill_graph_max_tokens, "max_model_len": args.max_model_len,
            "num_kv_blocks": args.num_kv_blocks, "chunked_prefill": not getattr(args, "no_chunked_prefill", False),
            "prefix_caching": not getattr(args, "no_prefix_caching", False),
            "max_num_batched_tokens": args.max_num_batched_tokens}
