"""llmserve serve: build the engine, wrap it in the OpenAI-compatible app, run uvicorn.

    llmserve serve                                   # tiny random model on CPU, 127.0.0.1:8000
    llmserve serve Qwen/Qwen2.5-1.5B --device cuda --host 0.0.0.0 --api-key-file key.txt

Shutdown (SIGINT/SIGTERM): uvicorn stops accepting connections and waits up to
--shutdown-timeout seconds for in-flight responses; then their handlers are cancelled, which
aborts their engine requests (freeing KV blocks), and the engine loop stops.

Authentication: with --api-key, --api-key-file or the environment variable LLMSERVE_API_KEY,
every route needs "Authorization: Bearer <key>" (401 otherwise), the tokenizer routes and the API
docs included; /health and /metrics stay open unless --api-key-protect-metrics.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

log = logging.getLogger("llmserve.serve.server")


def add_serve_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``serve`` on an ``argparse`` sub-parser set; ``args.func`` runs it."""
    from .guard import DEFAULT_MAX_REQUEST_BODY_BYTES

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model to serve (as --model; vllm serve MODEL style)")
    p.add_argument("--model", default="tiny",
                   help="'tiny' (embedded random Qwen2, the default), a local checkpoint directory, or a hub id")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--seed", type=int, default=0, help="engine seed (unseeded sampling)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 in a container)")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--max-num-seqs", "--max-batch-size", dest="max_batch_size", type=int, default=8, metavar="N",
                   help="most sequences per engine step")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (default: 2048 on CUDA; on a CPU one prefill chunk "
                        "plus one token per sequence, so a long prompt never stalls running decodes)")
    p.add_argument("--prefill-chunk-size", "--prefill-chunk", dest="prefill_chunk_size", type=int, default=None,
                   help="most prompt tokens of one sequence in a step (default: 512 on CUDA, 64 on a CPU; "
                        "0 turns chunked prefill off)")
    p.add_argument("--max-model-len", type=int, default=4096, help="context length cap (tokens)")
    p.add_argument("--policy", default="fcfs", choices=["fcfs", "sjf", "priority"], help="waiting-queue order")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks (default: from the memory budget / free GPU memory)")
    p.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true",
                   default=True, help="share the KV of equal prompt prefixes (default on)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn prefix caching off")
    p.add_argument("--attention-backend", "--paged-attention-backend", dest="paged_attention_backend",
                   default="torch", choices=["torch", "triton"], help="paged attention implementation")
    p.add_argument("--linear-backend", default="torch", choices=["torch", "int8", "int4", "triton-int8"],
                   help="projection implementation (int8/int4: weight-only quantized)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                   help="replay decode steps from CUDA graphs (CUDA, Triton attention backend; default on)")
    from ..config import add_fast_path_args, add_parallel_args
    add_fast_path_args(p)
    add_parallel_args(p)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch step n+1 before reading step n's tokens (default: on for CUDA)")
    p.add_argument("--speculative-model", default=None, metavar="PATH|tiny",
                   help="draft model for speculative decoding ('tiny', a checkpoint directory, a hub id, "
                        "random:<preset>, or 'target'); acceptance counters appear in /metrics")
    p.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="draft tokens proposed per step with --speculative-model (default 4)")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="answer 429 while this many requests wait for the engine (0 = unbounded)")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help=f"answer 413 to larger request bodies before reading them (default "
                        f"{DEFAULT_MAX_REQUEST_BODY_BYTES} = 8 MiB; 0 = no limit)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the --model value)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and /metrics (visible in the process list: "
                        "prefer --api-key-file or LLMSERVE_API_KEY)")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="read the API key from the first line of FILE")
    p.add_argument("--api-key-protect-metrics", action="store_true",
                   help="require the API key on /health and /metrics too")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds to drain in-flight requests on shutdown before aborting them")
    p.add_argument("--no-kernel-warmup", dest="kernel_warmup", action="store_false",
                   help="serve without first compiling the GPU kernels on synthetic requests (CUDA only; "
                        "otherwise the first real requests pay for Triton compilations in their TTFT)")
    p.add_argument("--disable-access-log", "--disable-uvicorn-access-log", dest="access_log",
                   action="store_false", help="do not log one line per HTTP request (on by default)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="log level of llmserve and uvicorn")
    p.set_defaults(func=run_serve_cli)
    return p


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """The API key from ``--api-key``, ``--api-key-file`` or ``LLMSERVE_API_KEY`` (first found).

    Raises:
        ValueError: both flags given, an unreadable or empty key file, or
            ``--api-key-protect-metrics`` without a key.
    """
    key, path = getattr(args, "api_key", None), getattr(args, "api_key_file", None)
    if key is not None and path is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as e:
            raise ValueError(f"--api-key-file {path!r} cannot be read: {e.strerror}") from None
        if not key:
            raise ValueError(f"--api-key-file {path!r} is empty; write the key on its first line")
    elif key is not None and not key.strip():
        raise ValueError("--api-key must not be empty")
    if key is None:
        from ..envs import api_key as _env_api_key

        key = _env_api_key()
    if key is None and getattr(args, "api_key_protect_metrics", False):
        raise ValueError("--api-key-protect-metrics needs an API key (--api-key, --api-key-file or LLMSERVE_API_KEY)")
    return key.strip() if key else None


def _model_name(args: argparse.Namespace) -> str:
    tag, flag = getattr(args, "model_tag", None), getattr(args, "model", None)
    if tag and flag and flag != "tiny" and tag != flag:
        raise ValueError(f"the model is given twice, as {tag!r} and as --model {flag!r}; give it once")
    return tag or flag or "tiny"


def serving_token_budget(device: str, chunk: int | None, budget: int | None,
                         max_num_seqs: int) -> tuple[int | None, int]:
    """The server's chunked-prefill defaults: ``(prefill_chunk_size, max_num_batched_tokens)``.

    Chunked prefill is on by default, as in vLLM V1, and running sequences (decodes first) are
    scheduled before new prompts, so a long prompt arriving costs each running decode at most one
    chunk of work per step (Sarathi-Serve, Agrawal et al., OSDI 2024). Defaults: on CUDA chunks of
    512 tokens in a 2,048-token step (vLLM's budget for online serving); on a CPU, where a step's
    time grows with its tokens, chunks of 64 and a budget of one chunk plus one token per
    sequence. ``chunk=0`` turns chunking off (a prompt is prefilled whole, so the budget then
    defaults to 4,096 tokens). Explicit values win.
    """
    on_cpu = str(device) == "cpu"
    if chunk is None:
        chunk = 64 if on_cpu else 512
    if chunk == 0:
        return None, budget if budget is not None else 4096
    if budget is None:
        budget = chunk + max_num_seqs if on_cpu else max(2048, chunk)
    return chunk, budget


def build_engine_config(args: argparse.Namespace):
    """EngineConfig from ``serve`` flags (ValueError names a bad field)."""
    from ..config import CacheConfig, EngineConfig, SchedulerConfig, fast_path_from_args

    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    chunk, budget = serving_token_budget(args.device, args.prefill_chunk_size, args.max_num_batched_tokens,
                                         args.max_batch_size)
    return EngineConfig(
        model=_model_name(args), device=args.device, dtype=dtype, seed=args.seed,
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                          enable_prefix_caching=getattr(args, "enable_prefix_caching", True)),
        scheduler=SchedulerConfig(mode="continuous", policy=args.policy, max_num_seqs=args.max_batch_size,
                                  max_num_batched_tokens=budget,
                                  prefill_chunk_size=chunk, max_model_len=args.max_model_len),
        attention_backend=args.paged_attention_backend, linear_backend=args.linear_backend,
        use_cuda_graph=getattr(args, "cuda_graph", True),
        async_scheduling=getattr(args, "async_scheduling", None), fast_path=fast_path_from_args(args),
        batch_invariant=getattr(args, "batch_invariant", False),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        distributed_timeout_s=getattr(args, "distributed_timeout_s", 300.0))


def build_app(args: argparse.Namespace):
    """Engine + app for the parsed flags (the app owns and stops the engine)."""
    from ..engine.async_engine import AsyncLLMEngine
    from ..engine.llm_engine import LLMEngine
    from .app import create_app

    if args.max_waiting is not None and args.max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0 (0 = unbounded), got {args.max_waiting}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if getattr(args, "max_request_body_bytes", 1) < 0:
        raise ValueError(f"--max-request-body-bytes must be >= 0 (0 = no limit), got {args.max_request_body_bytes}")
    api_key = resolve_api_key(args)
    model = _model_name(args)
    if getattr(args, "speculative_model", None):
        from ..engine.speculative import SpeculativeEngine
        engine = SpeculativeEngine(build_engine_config(args), draft_model=args.speculative_model,
                                   num_speculative_tokens=args.num_speculative_tokens)
    else:
        engine = LLMEngine(build_engine_config(args))
    if getattr(args, "kernel_warmup", True):
        try:
            info = engine.warmup()
        except Exception as e:  # noqa: BLE001 - serve anyway; the first requests then compile
            log.warning("kernel warm-up failed (%s: %s); serving without it", type(e).__name__, e)
        else:
            if "skipped" not in info:
                log.info("kernel warm-up: %d synthetic requests, %.1f s, %s Triton compilations",
                         info["requests"], info["seconds"], info["triton_compiles"])
    max_waiting = args.max_waiting or None
    async_engine = AsyncLLMEngine(engine, max_waiting=max_waiting)
    name = args.served_model_name or model
    aliases = tuple(a for a in {model, str(getattr(engine, "model_path", "") or "")} if a and a != name)
    return create_app(async_engine, served_model_name=name, model_aliases=aliases, max_waiting=max_waiting,
                      shutdown_timeout=args.shutdown_timeout, owns_engine=True,
                      max_request_body_bytes=getattr(args, "max_request_body_bytes", None) or None,
                      api_key=api_key, api_key_protects_metrics=getattr(args, "api_key_protect_metrics", False))


def run_serve_cli(args: argparse.Namespace) -> int:
    """Entry point of ``llmserve serve``; blocks until the server stops. Returns 0."""
    import uvicorn

    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(args)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout,
                            access_log=getattr(args, "access_log", True))
    server = uvicorn.Server(config)
    _exit_on_signal(server)
    server.run()
    return 0


def _exit_on_signal(server: Any) -> None:
    """SIGINT/SIGTERM ask ``server`` to shut down gracefully.

    uvicorn captures these signals while it serves and, after its graceful shutdown, re-raises
    them to the handler that was installed before; with the default handler the process would
    then die by the signal (exit status 143) although it shut down cleanly. This handler makes
    the re-raise a no-op (exit status 0) and also covers a signal arriving just before uvicorn
    installs its own handlers.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def _handler(signum, frame) -> None:  # noqa: ARG001
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _handler)


class BackgroundServer:
    """Run an app under uvicorn in a background thread (tests, notebooks, benchmarks).

    Binds ``host:port`` (``port=0`` picks a free port; read :attr:`port` after :meth:`start`).
    Use as a context manager, or call :meth:`start` / :meth:`stop`.

    Args:
        app: an ASGI app (``create_app(...)``).
        host: bind address (loopback by default).
        port: TCP port, 0 for any free one.
        shutdown_timeout: uvicorn's graceful-shutdown wait for open responses (seconds).
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 5.0,
                 log_level: str = "warning", access_log: bool = False) -> None:
        import uvicorn

        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                                     timeout_graceful_shutdown=shutdown_timeout, lifespan="on")
        self.server = uvicorn.Server(self.config)
        self.host = host
        self.port = port
        self._thread = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        """Start serving; returns once the socket listens. Raises RuntimeError if it does not."""
        import threading
        import time

        self._thread = threading.Thread(target=self.server.run, name="llmserve-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        for srv in self.server.servers:
            for sock in srv.sockets:
                self.port = sock.getsockname()[1]
                break
        return self

    def stop(self, timeout: float = 30.0) -> bool:
        """Ask uvicorn to exit (graceful: drains, then cancels); True if the thread ended."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            alive = self._thread.is_alive()
            if not alive:
                self._thread = None
            return not alive
        return True

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
