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
    from ..engine_args import add_engine_args
    g = p.add_argument_group("engine")
    add_engine_args(g)
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 in a container)")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
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
    p.add_argument("--trace", default=None, metavar="FILE.jsonl",
                   help="write every request's lifecycle events (queued, prefill chunks, first token, "
                        "decode steps, preemptions, finish) as JSON lines, appended about once a "
                        "second; gzip when the name ends in .gz (default: off)")
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


def build_engine_config(args: argparse.Namespace):
    """The :class:`~llmserve.config.EngineConfig` of ``serve``'s flags: continuous batching with
    the server's step budget (:func:`llmserve.engine_args.device_defaults`, usage ``"server"``).

    Raises:
        ValueError: a bad field, naming it; the model given twice.
    """
    import dataclasses

    from ..engine_args import EngineArgs

    eargs = dataclasses.replace(EngineArgs.from_namespace(args), model=_model_name(args))
    return eargs.create_engine_config("server")


def describe_startup(startup: dict) -> str:
    """One line of an engine's start-up record (``LLMEngine.startup``): seconds per phase and
    the KV pool."""
    parts = [f"{k[:-2].replace('_', ' ')} {v:.1f} s" for k, v in startup.items() if k.endswith("_s")]
    if startup.get("num_kv_blocks") is not None:
        parts.append(f"KV cache {startup['num_kv_blocks']} blocks "
                     f"({startup.get('kv_cache_bytes', 0) / 2**30:.2f} GiB)")
    return ", ".join(parts) or "no start-up record"


def build_app(args: argparse.Namespace):
    """Engine + app for the parsed flags (the app owns and stops the engine)."""
    from ..engine.async_engine import AsyncLLMEngine
    from ..engine import build_engine
    from ..engine_args import describe_config
    from .app import create_app

    if args.max_waiting is not None and args.max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0 (0 = unbounded), got {args.max_waiting}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if getattr(args, "max_request_body_bytes", 1) < 0:
        raise ValueError(f"--max-request-body-bytes must be >= 0 (0 = no limit), got {args.max_request_body_bytes}")
    if getattr(args, "trace", None):     # before the model loads: a bad path fails in a second
        from ..core.trace import check_trace_path
        check_trace_path(args.trace)
    api_key = resolve_api_key(args)
    model = _model_name(args)
    config = build_engine_config(args)
    log.info("engine: %s", describe_config(config))
    engine = build_engine(config, speculative_model=getattr(args, "speculative_model", None),
                          num_speculative_tokens=getattr(args, "num_speculative_tokens", 4))
    if getattr(args, "kernel_warmup", True):
        try:
            info = engine.warmup()
        except Exception as e:  # noqa: BLE001 - serve anyway; the first requests then compile
            log.warning("kernel warm-up failed (%s: %s); serving without it", type(e).__name__, e)
        else:
            if "skipped" not in info:
                log.info("kernel warm-up: %d synthetic requests, %.1f s, %s Triton compilations",
                         info["requests"], info["seconds"], info["triton_compiles"])
    log.info("ready: %s", describe_startup(getattr(engine, "startup", None) or {}))
    max_waiting = args.max_waiting or None
    async_engine = AsyncLLMEngine(engine, max_waiting=max_waiting, trace_path=getattr(args, "trace", None))
    if async_engine.trace_path is not None:
        log.info("request trace: %s", async_engine.trace_path)
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
