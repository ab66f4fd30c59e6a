"""Command line: ``llmserve generate | benchmark | serve | quantize-eval | bench-compare``."""

from __future__ import annotations

import argparse
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine."""
    p.add_argument("--model", default="tiny",
                   help="'tiny' (embedded random Qwen2), a local checkpoint directory, or a hub id")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--seed", type=int, default=0)


def default_dtype(device: str, dtype: str | None) -> str:
    """fp32 on CPU, bf16 on CUDA unless given."""
    if dtype:
        return dtype
    return "float32" if device == "cpu" else "bfloat16"


def _cmd_generate(args: argparse.Namespace) -> int:
    from .config import CacheConfig, EngineConfig, SchedulerConfig, fast_path_from_args
    from .engine.llm_engine import LLMEngine
    from .engine.naive import NaiveEngine
    from .core.sampling_params import SamplingParams

    cfg = EngineConfig(model=args.model, device=args.device, dtype=default_dtype(args.device, args.dtype),
                       seed=args.seed, cache=CacheConfig(block_size=args.block_size),
                       scheduler=SchedulerConfig(max_model_len=args.max_model_len),
                       attention_backend=args.paged_attention_backend,
                       use_cuda_graph=args.cuda_graph, fast_path=fast_path_from_args(args))
    engine = NaiveEngine(cfg) if args.naive else LLMEngine(cfg)
    prompt = args.prompt
    if args.chat:
        from .tokenizer import apply_chat_template
        prompt = apply_chat_template(engine.tokenizer, [{"role": "user", "content": prompt}])
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, seed=args.seed if args.temperature > 0 else None,
                        ignore_eos=args.ignore_eos)
    out = engine.generate([prompt], sp)[0]
    text = engine.tokenizer.decode(out.output_token_ids, skip_special_tokens=True)
    if args.show_ids:
        print(f"prompt ids: {out.prompt_token_ids}", file=sys.stderr)
        print(f"output ids: {out.output_token_ids}", file=sys.stderr)
    print(text)
    print(f"[{len(out.output_token_ids)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt and print the text")
    add_engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the ChatML template")
    g.add_argument("--naive", action="store_true", help="use the sequential no-cache control engine")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument("--paged-attention-backend", default="torch", choices=["torch", "triton"])
    g.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                   help="replay decode steps from CUDA graphs (CUDA, Triton attention backend; default on)")
    from .config import add_fast_path_args
    add_fast_path_args(g)
    g.add_argument("--show-ids", action="store_true")
    g.set_defaults(func=_cmd_generate)

    # Subcommands whose modules own their flags; a missing optional dependency only disables
    # that one command.
    optional = [
        ("benchmark", "llmserve.bench.runner", "add_benchmark_subparser"),
        ("serve", "llmserve.serve.server", "add_serve_subparser"),
        ("quantize-eval", "llmserve.bench.quantize_eval", "add_quantize_eval_subparser"),
        ("bench-compare", "llmserve.bench.compare", "add_bench_compare_subparser"),
    ]
    import importlib
    for name, module, fn in optional:
        try:
            getattr(importlib.import_module(module), fn)(sub)
        except ImportError as e:
            p = sub.add_parser(name, help=f"(unavailable: {e})")
            p.set_defaults(func=lambda a, e=e: (print(f"unavailable: {e}", file=sys.stderr), 2)[1])
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
