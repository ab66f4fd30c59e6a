"""Command line: llmserve generate | benchmark | serve | quantize-eval | bench-compare | bench-kernels.

Every command that builds an engine takes --device, --dtype, --seed and --torch-threads; run
'llmserve COMMAND --help' for the rest."""

from __future__ import annotations

import argparse
import sys

from .engine_args import int_at_least


def add_torch_threads_arg(p: argparse.ArgumentParser) -> None:
    """``--torch-threads`` (resolved by :func:`resolve_torch_threads`)."""
    p.add_argument("--torch-threads", type=int_at_least(0), default=None, metavar="N",
                   help="PyTorch intra-op CPU threads (default: 1 with --device cpu, where the tiny "
                        "model's small matrices run several times faster on one thread than on many; "
                        "PyTorch's own default with CUDA; 0 = PyTorch's default)")


def resolve_torch_threads(device: str | None, requested: int | None) -> int | None:
    """Apply ``--torch-threads``: ``None`` means 1 on CPU and PyTorch's default otherwise; 0
    means PyTorch's default. Returns the thread count in force (``None`` if torch is unused)."""
    import torch

    n = requested
    if n is None:
        n = 1 if (device or "cpu") == "cpu" else 0
    if n > 0:
        torch.set_num_threads(n)
    return torch.get_num_threads()


class DeviceError(ValueError):
    """The requested device does not exist on this machine."""


def check_device(device: str | None) -> None:
    """Fail early, in one line, for a device this machine lacks.

    Raises:
        DeviceError: ``cuda``/``cuda:N`` without CUDA (or without GPU ``N``), or an unknown name.
    """
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise DeviceError(f"--device {device!r} is not a device name; use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise DeviceError(f"--device {device!r} is not supported; use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise DeviceError(f"--device {device} was requested but CUDA is not available on this machine "
                          f"(torch {torch.__version__}, built with CUDA {torch.version.cuda or 'none'}); "
                          "use --device cpu")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise DeviceError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                          f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")


def plain_help(text: str | None) -> str | None:
    """A docstring as ``--help`` text: reST roles and literals become plain words
    (:class:`~a.b.C` -> C, ``x`` -> x)."""
    import re

    if text is None:
        return None
    text = re.sub(r":[a-z]+:`~?([^`]*?)`", lambda m: m.group(1).rsplit(".", 1)[-1] if "~" in m.group(0)
                  else m.group(1), text)
    return text.replace("``", "")


def _cmd_generate(args: argparse.Namespace) -> int:
    from .engine import build_engine
    from .engine_args import EngineArgs

    eargs = EngineArgs.from_namespace(args)
    engine = build_engine(eargs.create_engine_config("offline"), naive=args.naive,
                          speculative_model=eargs.speculative_model,
                          num_speculative_tokens=eargs.num_speculative_tokens)
    try:
        return _generate(engine, args)
    finally:
        engine.shutdown()


def _generate(engine, args: argparse.Namespace) -> int:
    from .core.sampling_params import SamplingParams

    prompt = args.prompt
    if args.chat:
        from .tokenizer import apply_chat_template
        prompt = apply_chat_template(engine.tokenizer, [{"role": "user", "content": prompt}])
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, seed=(args.seed or 0) if args.temperature > 0 else None,
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
    parser = argparse.ArgumentParser(prog="llmserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt and print the text")
    from .engine_args import add_engine_args
    add_engine_args(g.add_argument_group("engine"))
    g.add_argument("--prompt", required=True, help="the text to complete")
    g.add_argument("--max-tokens", type=int, default=32, help="output tokens at most (default 32)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]; 1 disables it")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 disables it")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-text token")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the ChatML template")
    g.add_argument("--naive", action="store_true", help="use the sequential no-cache control engine")
    g.add_argument("--show-ids", action="store_true", help="print prompt and output token ids to stderr")
    add_torch_threads_arg(g)
    g.set_defaults(func=_cmd_generate)

    # Subcommands whose modules own their flags; a missing optional dependency only disables
    # that one command.
    optional = [
        ("benchmark", "llmserve.bench.runner", "add_benchmark_subparser"),
        ("serve", "llmserve.serve.server", "add_serve_subparser"),
        ("quantize-eval", "llmserve.bench.quantize_eval", "add_quantize_eval_subparser"),
        ("bench-compare", "llmserve.bench.compare", "add_bench_compare_subparser"),
        ("bench-kernels", "llmserve.bench.kernels", "add_bench_kernels_subparser"),
    ]
    import importlib
    for name, module, fn in optional:
        try:
            getattr(importlib.import_module(module), fn)(sub)
        except ImportError as e:
            p = sub.add_parser(name, help=f"(unavailable: {e})")
            p.set_defaults(func=lambda a, e=e: (print(f"unavailable: {e}", file=sys.stderr), 2)[1])
            continue
        p = sub.choices[name]
        if any("--device" in a.option_strings for a in p._actions):
            add_torch_threads_arg(p)        # every command that builds an engine
    for p in sub.choices.values():          # module docstrings as plain --help text
        p.description = plain_help(p.description)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        device = getattr(args, "device", "cuda" if args.command == "bench-compare" else None)
        check_device(device)
        if hasattr(args, "torch_threads"):
            args.torch_threads = resolve_torch_threads(device, args.torch_threads)
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"llmserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from .engine.tensor_parallel import TensorParallelError

        if not isinstance(e, TensorParallelError):
            raise
        print(f"llmserve {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
