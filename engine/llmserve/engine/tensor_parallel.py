"""The tensor-parallel process model: one process a rank, on one host.

Rank 0 is the caller's process: it owns the :class:`~llmserve.engine.llm_engine.LLMEngine`
(scheduler, block manager, sampler, tokenizer). With ``EngineConfig.tensor_parallel_size = N``
it either

* spawns ranks ``1 .. N-1`` itself (``torch.multiprocessing``'s spawn context, daemonic
  processes), meeting them through a ``TCPStore`` on 127.0.0.1 at a free port; or
* under ``torchrun`` (``RANK`` / ``WORLD_SIZE`` set, ``WORLD_SIZE == N``) uses the processes
  torchrun started: rank 0 builds the engine, and on the other ranks the ``LLMEngine``
  constructor serves as a worker until rank 0 shuts down, then raises ``SystemExit`` (so the
  same script runs on every rank).

Every rank loads its shards (:mod:`llmserve.models.parallel`), builds the same forward and its
own KV cache (its K/V heads; the ranks agree on the smallest block count). Each step rank 0
broadcasts the packed inputs (:mod:`llmserve.worker.step_channel`), every rank runs the same
forward (two all-reduces a layer, one for the embedding, the logits gathered on rank 0) and
rank 0 samples. Rank ``r`` uses ``cuda:(d + r)`` for ``device="cuda:d"`` (NCCL; NVLink multicast
off, :func:`llmserve.envs.set_nccl_multicast_off`), the CPU otherwise (gloo).

Failure: a worker that raises writes its traceback to the store and exits; a worker that dies
closes its connections, so rank 0's next collective fails at once (gloo), and a watcher thread
aborts NCCL's communicators when a spawned worker exits (so no collective waits for it); a rank
that hangs is bounded by ``distributed_timeout_s``. Rank 0 then raises
:class:`TensorParallelError` naming the rank, its exit code and its error, stops the other
ranks, and every later ``step()`` raises the same error. Workers exit when rank 0 sends stop
(:meth:`TensorParallelRuntime.shutdown`, also run at interpreter exit), when rank 0's process
ends (a thread watches the parent process) or when its connections close.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import EngineConfig
from ..envs import set_nccl_multicast_off, torchrun_rank

__all__ = ["TensorParallelError", "TensorParallelRuntime", "start_tensor_parallel", "worker_main"]

_log = logging.getLogger(__name__)

#: Exit code of a worker whose parent (rank 0) is gone.
EXIT_PARENT_GONE = 3


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed (died, raised, or did not answer within
    ``distributed_timeout_s``); the engine cannot run further steps."""


def _timeout(config: EngineConfig) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(config.distributed_timeout_s))


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    """The device of local rank ``local_rank``: the CPU, or ``cuda:(d + local_rank)`` for
    ``config.device`` ``cuda:d`` (``cuda`` is ``cuda:0``)."""
    dev = torch.device(config.device)
    if dev.type != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", (dev.index or 0) + local_rank)


def _check_devices(config: EngineConfig) -> None:
    dev = torch.device(config.device)
    if dev.type != "cuda":
        return
    first, n = dev.index or 0, config.tensor_parallel_size
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if first + n > have:
        raise ValueError(f"tensor_parallel_size={n} on device {config.device!r} needs GPUs cuda:{first}.."
                         f"cuda:{first + n - 1}; this machine has {have}")


@dataclass(frozen=True)
class _WorkerArgs:
    """What a spawned worker needs (pickled to it)."""

    config: EngineConfig
    rank: int
    port: int
    load_model_fn: Callable | None
    num_threads: int


@dataclass
class _Groups:
    device_group: object
    control_group: object
    owns_default: bool


def _init_groups(config: EngineConfig, rank: int, device: torch.device, store=None) -> _Groups:
    """Join the default process group (``store``: the spawn rendezvous; None: ``env://``, as
    torchrun sets it; an existing default group of the right size is reused) and create the
    gloo control group. Every rank calls this in the same order."""
    import torch.distributed as dist

    from ..worker.step_channel import IDLE_TIMEOUT

    size = config.tensor_parallel_size
    backend = "nccl" if device.type == "cuda" else "gloo"
    owns = False
    if dist.is_initialized():
        if dist.get_world_size() != size or dist.get_rank() != rank:
            raise ValueError(f"the existing torch.distributed group has world size {dist.get_world_size()} "
                             f"and this process is rank {dist.get_rank()}; tensor_parallel_size={size} "
                             f"needs world size {size}")
    else:
        kw = {"store": store} if store is not None else {"init_method": "env://"}
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, rank=rank, world_size=size, timeout=_timeout(config), **kw)
        owns = True
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return _Groups(dist.group.WORLD, control, owns)


def _destroy(groups: _Groups | None, abort: bool = False) -> None:
    import torch.distributed as dist

    if groups is None or not dist.is_initialized():
        return
    try:
        if abort and hasattr(dist.distributed_c10d, "_abort_process_group"):
            dist.distributed_c10d._abort_process_group()
        elif groups.owns_default:
            dist.destroy_process_group()
        else:
            dist.destroy_process_group(groups.control_group)
    except Exception as e:  # noqa: BLE001 - tearing down after a failure
        _log.debug("destroying the tensor-parallel process groups: %s", e)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        return f"was killed by signal {-code}"
    if code == EXIT_PARENT_GONE:
        return "exited because rank 0's process was gone"
    return f"exited with code {code}"


class TensorParallelRuntime:
    """Rank 0's side of the group: the processes, the groups, the step channel, the failure
    record. Built by :func:`start_tensor_parallel`.

    Attributes:
        size, rank: the number of ranks and this one (0).
        device: rank 0's device.
        group: rank 0's :class:`~llmserve.models.parallel.TensorParallelGroup` (set once the
            model's config is known).
        channel: the :class:`~llmserve.worker.step_channel.StepChannel` steps go through.
        failed: the :class:`TensorParallelError` that ended the group, or None.
        worker_pids: process ids of the spawned ranks 1..N-1 (empty under torchrun).
    """

    def __init__(self, config: EngineConfig, device: torch.device, groups: _Groups, group, procs,
                 store) -> None:
        from ..worker.step_channel import StepChannel

        self.config = config
        self.size = config.tensor_parallel_size
        self.rank = 0
        self.device = device
        self.group = group
        self._groups = groups
        self._procs = procs                    # {rank: process}
        self._store = store
        self.channel = StepChannel(groups.control_group, groups.device_group, device, 0)
        self.failed: TensorParallelError | None = None
        self._closing = False
        self._closed = False
        self._lock = threading.Lock()
        self._watcher = None
        if procs:
            self._watcher = threading.Thread(target=self._watch, name="llmserve-tp-watch", daemon=True)
            self._watcher.start()

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs.values()]

    # ---- failure -------------------------------------------------------------------------------
    def _watch(self) -> None:
        """Wait for a spawned rank to exit; when one does before shutdown, abort NCCL's
        communicators so that no rank 0 collective waits for it (gloo fails on its own)."""
        from multiprocessing.connection import wait

        sentinels = {p.sentinel: r for r, p in self._procs.items()}
        while sentinels and not self._closing:
            for s in wait(list(sentinels)):
                sentinels.pop(s, None)
            if not self._closing and self._groups is not None and self.device.type == "cuda":
                _log.error("a tensor-parallel rank exited; aborting the NCCL communicators")
                _destroy(self._groups, abort=True)
                return

    def _worker_error(self, rank: int) -> str | None:
        try:
            key = f"error/{rank}"
            if self._store is not None and self._store.check([key]):
                return self._store.get(key).decode("utf-8", "replace")
        except Exception:  # noqa: BLE001 - best effort
            return None
        return None

    def _dead_ranks(self, wait_s: float = 0.0) -> list[int]:
        deadline = time.monotonic() + wait_s
        while True:
            dead = [r for r, p in self._procs.items() if p.exitcode is not None]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.02)

    def dead_ranks(self) -> list[int]:
        """The spawned ranks that have exited (none under torchrun)."""
        return self._dead_ranks()

    def _error(self, cause: BaseException | None) -> TensorParallelError:
        # a collective can fail a moment before the peer's exit is visible: wait briefly
        dead = self._dead_ranks(wait_s=2.0 if cause is not None else 0.0)
        parts = []
        for r in dead:
            p = self._procs[r]
            msg = f"tensor-parallel rank {r} (pid {p.pid}) {_describe_exit(p.exitcode)}"
            err = self._worker_error(r)
            if err:
                msg += f"; its error:\n{err.rstrip()}"
            parts.append(msg)
        if not parts:
            where = "a tensor-parallel rank" if not self._procs else "a tensor-parallel collective"
            parts.append(f"{where} failed or did not answer within distributed_timeout_s="
                         f"{self.config.distributed_timeout_s:g} s")
        if cause is not None:
            parts.append(f"rank 0 saw: {type(cause).__name__}: {cause}")
        return TensorParallelError("; ".join(parts) + ". The engine cannot continue; build a new one.")

    def check(self) -> None:
        """Raise the recorded failure, or a new one if a spawned rank has exited."""
        if self.failed is not None:
            raise self.failed
        if self._closed:
            raise TensorParallelError("the tensor-parallel engine was shut down")
        if self._dead_ranks():
            raise self.fail(None)

    def fail(self, cause: BaseException | None) -> TensorParallelError:
        """Record a failure (``cause``: what rank 0 caught), stop the other ranks and return
        the error to raise."""
        with self._lock:
            if self.failed is None:
                self.failed = self._error(cause)
                self._stop(send=False)
        return self.failed

    # ---- shutdown ------------------------------------------------------------------------------
    def _stop(self, send: bool, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closing = True
        if send:
            try:
                self.channel.send_stop()
            except Exception as e:  # noqa: BLE001 - a rank already gone
                _log.debug("sending stop to the tensor-parallel ranks: %s", e)
        deadline = time.monotonic() + timeout
        for p in self._procs.values():
            p.join(max(0.0, deadline - time.monotonic()) if send else 0.5)
        for p in self._procs.values():
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        _destroy(self._groups, abort=not send and self.device.type == "cuda")
        self._groups = None
        self._store = None
        self._closed = True

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the other ranks (they leave their loop; spawned ones that do not exit within
        ``timeout`` seconds are terminated, then killed) and destroy the process groups.
        Idempotent."""
        with self._lock:
            self._stop(send=self.failed is None, timeout=timeout)


def _wait_for_hello(config: EngineConfig, store, procs: dict) -> None:
    """Wait until every spawned rank has reached the store (it imported torch and llmserve),
    failing at once when one exits first."""
    deadline = time.monotonic() + config.distributed_timeout_s
    keys = [f"hello/{r}" for r in procs]
    while not store.check(keys):
        dead = [r for r, p in procs.items() if p.exitcode is not None]
        if dead:
            raise TensorParallelError(f"tensor-parallel rank {dead[0]} (pid {procs[dead[0]].pid}) "
                                      f"{_describe_exit(procs[dead[0]].exitcode)} while starting")
        if time.monotonic() > deadline:
            raise TensorParallelError(f"tensor-parallel ranks did not start within distributed_timeout_s="
                                      f"{config.distributed_timeout_s:g} s")
        time.sleep(0.02)


def start_tensor_parallel(config: EngineConfig, load_model_fn: Callable | None = None
                          ) -> TensorParallelRuntime:
    """Rank 0: check the model against ``config.tensor_parallel_size``, start (or join) the
    other ranks and the process groups, and return the runtime with rank 0's
    :class:`~llmserve.models.parallel.TensorParallelGroup`. Under torchrun on a rank other than
    0 this serves as that rank's worker and raises ``SystemExit`` when rank 0 shuts down.

    Args:
        config: the engine configuration (``tensor_parallel_size > 1``).
        load_model_fn: the loader every rank uses (picklable for spawned ranks: a module-level
            function); None for :func:`~llmserve.models.loader.load_model`.

    Raises:
        ValueError: the size does not fit the model (:func:`~llmserve.models.parallel.plan_tensor_parallel`),
            too few GPUs, a torchrun world of another size, or a process group already in this
            process.
        TensorParallelError: a rank failed to start.
    """
    import torch.distributed as dist

    from ..models.loader import model_config_of
    from ..models.parallel import TensorParallelGroup, plan_tensor_parallel

    size = config.tensor_parallel_size
    model_config, path = model_config_of(config.model)
    plans = plan_tensor_parallel(model_config, size)
    if path is not None:        # the other ranks read the resolved directory (no second hub lookup)
        config = dataclasses.replace(config, model=str(path))
    run = torchrun_rank()
    if run is not None:
        rank, world, local = run
        if world != size:
            raise ValueError(f"torchrun started {world} processes (WORLD_SIZE) but tensor_parallel_size is "
                             f"{size}; start as many processes as ranks")
        device = rank_device(config, local)
        if device.type == "cuda":
            set_nccl_multicast_off()
        if rank != 0:
            raise SystemExit(serve_worker(config, rank, local, None, load_model_fn))
        groups = _init_groups(config, 0, device, None)
        return TensorParallelRuntime(config, device, groups, TensorParallelGroup(plans[0], groups.device_group),
                                     {}, None)

    _check_devices(config)
    if dist.is_initialized():
        raise ValueError("a torch.distributed process group already exists in this process; "
                         "tensor parallelism spawns its own ranks (or start the script with torchrun)")
    device = rank_device(config, 0)
    if device.type == "cuda":
        set_nccl_multicast_off()       # before spawning: the children inherit it
    store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=_timeout(config), wait_for_workers=False)
    ctx = torch.multiprocessing.get_context("spawn")
    procs = {}
    try:
        for r in range(1, size):
            p = ctx.Process(target=worker_main, name=f"llmserve-tp-rank{r}", daemon=True,
                            args=(_WorkerArgs(config, r, store.port, load_model_fn, torch.get_num_threads()),))
            p.start()
            procs[r] = p
        _wait_for_hello(config, store, procs)
        groups = _init_groups(config, 0, device, store)
    except BaseException:
        for p in procs.values():
            p.kill()
            p.join(2.0)
        raise
    return TensorParallelRuntime(config, device, groups, TensorParallelGroup(plans[0], groups.device_group),
                                 procs, store)


# ---- the other ranks ---------------------------------------------------------------------------
def _watch_parent() -> None:
    """Exit this process when its parent (rank 0) ends, whatever this process is doing."""
    import multiprocessing
    from multiprocessing.connection import wait

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def run() -> None:
        wait([parent.sentinel])
        os._exit(EXIT_PARENT_GONE)

    threading.Thread(target=run, name="llmserve-tp-parent", daemon=True).start()


def worker_main(args: _WorkerArgs) -> None:
    """Entry point of a spawned rank (``torch.multiprocessing`` spawn target): meet rank 0
    through its store, serve steps until told to stop, exit (code 0, or 1 after an error,
    whose traceback goes to stderr and to the store)."""
    import torch.distributed as dist

    _watch_parent()
    config = args.config
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    store = dist.TCPStore("127.0.0.1", args.port, config.tensor_parallel_size, False, timeout=_timeout(config))
    store.set(f"hello/{args.rank}", "1")
    code = serve_worker(config, args.rank, args.rank, store, args.load_model_fn)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)            # no interpreter teardown (nothing left to flush; NCCL may hang in it)


def serve_worker(config: EngineConfig, rank: int, local_rank: int, store, load_model_fn: Callable | None) -> int:
    """A non-zero rank's whole life: join the groups, build the same shard, forward and KV
    cache as rank 0, then run every step rank 0 sends until it sends stop. Returns the exit
    code (0 after stop, 1 after an error, which is printed and, with a ``store``, recorded
    under ``error/<rank>`` for rank 0's message)."""
    from ..models.loader import load_model, model_config_of
    from ..models.parallel import TensorParallelGroup, plan_tensor_parallel
    from ..worker.model_runner import ModelRunner
    from ..worker.step_channel import OP_STOP, StepChannel
    from .shard import allocate_kv_cache, build_fast_forward, load_shard

    groups = None
    try:
        device = rank_device(config, local_rank)
        model_config, _ = model_config_of(config.model)
        plan = plan_tensor_parallel(model_config, config.tensor_parallel_size)[rank]
        groups = _init_groups(config, rank, device, store)
        tp = TensorParallelGroup(plan, groups.device_group)
        torch.manual_seed(config.seed)
        shard = load_shard(config, device, load_model_fn or load_model, tp)
        forward = build_fast_forward(shard)
        kv = allocate_kv_cache(config, shard.model_config, shard.model.dtype, device, tp)
        runner = ModelRunner(shard.model, kv.kv_caches, config.cache.block_size, device, forward=forward)
        channel = StepChannel(groups.control_group, groups.device_group, device, rank)
        while True:
            msg = channel.recv(runner.inputs)
            if msg.op == OP_STOP:
                break
            runner.execute_received(msg.packed, msg.pending)
        _destroy(groups)
        return 0
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, then the process exits
        if isinstance(e, SystemExit):
            raise
        tb = traceback.format_exc()
        print(f"llmserve tensor-parallel rank {rank}: {tb}", file=sys.stderr, flush=True)
        if store is not None:
            try:
                store.set(f"error/{rank}", tb[-4000:])
            except Exception:  # noqa: BLE001 - rank 0 may be gone
                pass
        return 1
