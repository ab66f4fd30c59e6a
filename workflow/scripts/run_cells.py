"""Run a group of checkpoint-3 benchmark cells in one Python process.

Each cell is one ``llmserve benchmark`` run (same flags, same report and CSV, via
:func:`llmserve.bench.runner.run_benchmark`), but the cells of a group share one process: torch,
the tokenizer and the parsed ShareGPT prompts are loaded once instead of once per cell (on a
2-core CPU that start-up is 10-15 s a process; on a GPU it also keeps the CUDA context and the
compiled Triton kernels). The pipeline's ``group_cells_by`` chooses the groups: (sweep,
repetition) by default, so editing one sweep reruns that sweep's groups only and repetitions
are separate processes; a repetition; or everything (``all``, the GPU profiles), where the
repetitions of the cells of one engine setting run on one engine (below; repetition 0's cells
first, then 1's, ...) and their spread is run-to-run within one process.

Cells whose engines differ only in scheduling (scheduler mode and policy, prefill chunk size,
prefix caching: :func:`llmserve.engine.builder.parts_key`) run one after another, and each takes
over the previous one's device parts (weights, KV cache, CUDA graphs) through an
:class:`~llmserve.engine.builder.EnginePartsCache` instead of building and capturing them again;
its scheduler, block manager, sampler and counters are its own. The group keeps the spec's
order otherwise (cells of one engine setting gathered where the first of them stands); each
provenance file records the position a cell ran at.

Usage (the pipeline's benchmark rules run it)::

    python workflow/scripts/run_cells.py run --spec SPEC.json|'{...}' --raw results/.../raw \\
        --log-dir results/.../logs/benchmark --code-hash H --device cpu --torch-threads 1
    python workflow/scripts/run_cells.py finalize --spec ... --raw ... --exit-status RC ...

``spec`` maps cell id -> the cell's ``llmserve benchmark`` flags (without ``--output``/``--csv``).
``run`` writes ``<raw>/<cell>.json``, ``.csv`` and ``.provenance.json`` per cell, in order; the
provenance file records the machine's load during the cell (``machine_load``: other processes'
CPU, stolen time, load average, core count and CPU model, GPU clocks; ``machine_load.py``). A cell
that fails is a ``status: failed`` report (the harness writes it) and the group goes on.
``finalize`` runs after ``run`` whatever its exit status: a cell left without a provenance file
(the process was killed, ran out of memory, segfaulted) gets a failed report in its place, so a
crash is a failed row, never a hole. Only a broken pipeline (an unknown flag, sources edited
while the group runs) fails the job.

A cell whose flags carry ``--trace FILE`` declares that file as one more output: the harness
writes it when the run reaches its report, and ``finalize`` writes an empty trace for a cell
that left none (it failed before its measured phase, or the process died), so the job keeps its
outputs and the plot shows the failure instead of a missing file.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import shlex
import sys
import time
from pathlib import Path

import code_hash as ch  # noqa: E402  (workflow/scripts/, next to this file)
import machine_load  # noqa: E402


def load_spec(text: str) -> dict[str, str]:
    """``{cell id: flags}`` from inline JSON or a JSON file path."""
    raw = text if text.lstrip().startswith("{") else Path(text).read_text()
    spec = json.loads(raw)
    if not isinstance(spec, dict) or not all(isinstance(v, str) for v in spec.values()):
        raise ValueError("spec must be a JSON object mapping cell id -> flags string")
    return spec


def trace_path(flags: str) -> Path | None:
    """The ``--trace`` file a cell's flags name (``--trace FILE`` or ``--trace=FILE``), else None."""
    args = shlex.split(flags)
    for i, arg in enumerate(args):
        if arg == "--trace" and i + 1 < len(args):
            return Path(args[i + 1])
        if arg.startswith("--trace="):
            return Path(arg.split("=", 1)[1])
    return None


def write_empty_trace(path: Path) -> None:
    """An empty lifecycle trace at ``path`` (gzip when the name ends in ``.gz``; fixed bytes:
    no time stamp in the gzip header), which reads back as no events."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(b"", mtime=0) if path.suffix == ".gz" else b"")


def set_threads(n: int) -> int:
    """Fix torch's intra-op threads to ``n`` (before torch is used) and return what torch reports."""
    if n < 1:
        raise ValueError(f"--torch-threads must be >= 1, got {n}")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)
    import torch

    torch.set_num_threads(n)
    return int(torch.get_num_threads())


#: Engine flags that do not change which GPU kernels a cell compiles (sizes, seeds, policies): a
#: cell differing from an earlier cell of its process only in these skips the kernel warm-up,
#: unless its steps can be larger than the warmed cell's (:func:`covered`).
WARMUP_IRRELEVANT = frozenset({"seed", "policy", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                               "num_blocks", "gpu_memory_utilization"})


def kernel_signature(opts) -> tuple:
    """What selects the GPU kernels a cell compiles: its scheduler kind, whether it constrains
    output to a schema, and every engine setting except :data:`WARMUP_IRRELEVANT`.

    Triton compiles one kernel variant per argument specialisation (values that are 1 or
    multiples of 16, alignments); a process keeps what it compiled. A later cell with the same
    signature meets the same variants (its own graph capture and warm-up requests, which still
    run, compile any batch-size variant that is new), so its kernel warm-up only repeats work.
    Each report still counts the Triton compiles inside its measured window
    (``warmup.triton_compiles_measured``), so a variant this missed shows there.
    """
    import dataclasses

    from llmserve.engine_args import EngineArgs

    engine = tuple((f.name, repr(getattr(opts, f.name))) for f in dataclasses.fields(EngineArgs)
                   if f.name not in WARMUP_IRRELEVANT)
    return (opts.config, opts.json_schema is not None) + engine


def engine_config(opts):
    """The cell's :class:`~llmserve.config.EngineConfig`, or None when its flags or profile do
    not resolve (the cell then fails in its own run, with its report)."""
    from llmserve.bench.runner import engine_config_of

    try:
        return engine_config_of(opts)
    except (ValueError, FileNotFoundError):
        return None


def step_sizes(econf) -> tuple[int, int]:
    """``(max_num_seqs, max_num_batched_tokens)`` of a cell's engine config (0, 0 for None)."""
    if econf is None:
        return (0, 0)
    return (econf.scheduler.max_num_seqs, econf.scheduler.max_num_batched_tokens)


def covered(warmed: "list[tuple[int, int]] | tuple", sizes: tuple[int, int]) -> bool:
    """Whether a cell of step sizes ``sizes`` meets only kernel variants an earlier warm-up of
    its signature compiled: one of ``warmed`` was at least as large in both sizes. Eager steps
    of more sequences or tokens reach argument values (batch sizes, grid sizes) that a
    smaller engine's warm-up never ran: a batch-invariant cell at batch 64 after one at batch
    8 compiled the invariant attention kernel inside its measured phase."""
    return any(s >= sizes[0] and t >= sizes[1] for s, t in warmed)


def release_device_memory(device: str) -> int | None:
    """Free what the previous cell left on the device before the next one is built; return the
    device's free bytes afterwards (``None`` off CUDA).

    An engine sizes its KV cache from the device's free memory when it is built
    (``gpu_memory_utilization``), so a cell built while the previous cell's engine still waits
    for the garbage collector (reference cycles), or while PyTorch's caching allocator still
    holds that engine's freed blocks, gets a smaller cache than the one before it: an H100
    prefix sweep's eight cells of a process got 24,607 to 142,706 KV blocks, alternating with
    their place. Collecting and emptying the allocator's cache here gives every cell of a
    process the same free memory. The engine freezes the collector after its warm-up
    (``EngineConfig.freeze_gc``: frozen objects are never collected), so the previous cell's
    objects are unfrozen first; the next engine freezes its own again."""
    import gc

    gc.unfreeze()
    gc.collect()
    if not device.startswith("cuda"):
        return None
    import torch

    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def parse_cell(cell: str, flags: str, raw: Path):
    """The options of one cell (its ``--output``/``--csv`` under ``raw``); an unknown
    flag exits 2 (a broken pipeline stops)."""
    from llmserve.bench.runner import add_benchmark_args, options_from_args

    parser = argparse.ArgumentParser(prog="llmserve benchmark")
    add_benchmark_args(parser)
    argv = shlex.split(flags) + ["--output", str(raw / f"{cell}.json"), "--csv", str(raw / f"{cell}.csv")]
    opts = options_from_args(parser.parse_args(argv))
    opts.command = ["llmserve", "benchmark", *argv]
    return opts


def parts_group(opts, econf) -> object:
    """Cells of equal value can share one engine's device parts: the engine settings without
    the scheduling-only fields (:func:`llmserve.engine.builder.parts_key`); the naive control,
    speculative cells and cells whose settings do not resolve share nothing (a unique value each)."""
    from llmserve.engine.builder import parts_key

    if opts.config == "naive" or opts.speculative_model or econf is None:
        return object()
    return parts_key(econf)


def run_order(cells: list[str], groups: list[object]) -> list[int]:
    """Indices of ``cells`` in the order they run: the spec's, except that the cells of one
    parts group follow the first of them."""
    order: list[int] = []
    placed: set[int] = set()
    for i in range(len(cells)):
        if i in placed:
            continue
        for j in range(i, len(cells)):
            if j not in placed and (j == i or groups[j] == groups[i]):
                order.append(j)
                placed.add(j)
    return order


def run_group(spec: dict[str, str], raw: Path, log_dir: Path, expected_hash: str, device: str,
              torch_threads: int, group: str) -> int:
    """Run every cell of ``spec`` (in :func:`run_order`); return 1 if the sources changed
    mid-group, else 0."""
    t_process = time.perf_counter()
    threads = set_threads(torch_threads)
    from llmserve.bench.runner import run_benchmark
    from llmserve.engine.builder import EnginePartsCache

    t_ready = time.perf_counter()
    warmed: dict[tuple, list[tuple[int, int]]] = {}   # signature -> (max seqs, step tokens) warmed
    raw.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    cells = list(spec)
    parsed = [parse_cell(c, spec[c], raw) for c in cells]
    configs = [engine_config(opts) for opts in parsed]
    groups = [parts_group(opts, econf) for opts, econf in zip(parsed, configs)]
    parts = EnginePartsCache()
    prev: int | None = None
    for i, k in enumerate(run_order(cells, groups)):
        cell, flags = cells[k], spec[cells[k]]
        try:
            ch.check_unchanged(expected_hash, "since the workflow started")
        except ch.SourcesChanged as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        out, csv, prov = raw / f"{cell}.json", raw / f"{cell}.csv", raw / f"{cell}.provenance.json"
        trace = trace_path(flags)
        for p in (out, csv, prov, trace):
            if p is not None:
                p.unlink(missing_ok=True)   # an earlier run's trace never passes for this one's
        log = log_dir / f"{cell}.log"
        # each cell starts at the process's thread count (and records it): a batch-invariant
        # cell's engine on a CPU pins torch to one thread (engine/builder.py), which must not
        # carry over
        set_threads(torch_threads)
        opts = parsed[k]
        signature = kernel_signature(opts)
        sizes = step_sizes(configs[k])
        if covered(warmed.get(signature, ()), sizes):
            opts.kernel_warmup = False      # this process compiled these kernels already
        if prev is not None and groups[k] != groups[prev]:
            parts.clear()                   # another engine setting: its memory goes back first
        prev = k
        gpu = device.startswith("cuda")
        free_bytes = release_device_memory(device)   # every cell's KV cache sized from the same memory
        before = machine_load.snapshot(gpu=gpu)
        t0 = time.perf_counter()
        reuses = parts.reuses
        with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            report, _, _ = run_benchmark(opts, parts_cache=parts)
        reused = parts.reuses > reuses      # known even when the run failed before its report's warm-up
        took = time.perf_counter() - t0
        if opts.kernel_warmup and report.get("status") == "ok":
            warmed.setdefault(signature, []).append(sizes)   # only a cell that ran it, and ran, counts
        load = machine_load.summarize(before, machine_load.snapshot(gpu=gpu))
        ch.write_provenance(
            json_path=out, csv_path=csv, output=prov, cell=cell, exit_status=0,
            expected_code_hash=expected_hash, log=str(log), device=device,
            extra={"torch_threads": threads,
                   "process": {"group": group, "position": i, "cells_in_group": len(spec),
                               "process_startup_s": round(t_ready - t_process, 3),
                               "cell_wall_s": round(took, 3),
                               "reused_engine_parts": reused,
                               "kernel_warmup": opts.kernel_warmup,
                               "device_free_bytes_at_start": free_bytes},
                   # what else ran meanwhile: other processes' cores, stolen time, load average,
                   # this process's CPU share, the GPU's clocks (machine_load.py)
                   "machine_load": load})
        agg = report.get("aggregates") or {}
        print(f"[{i + 1}/{len(spec)}] {cell}: {report['status']}, "
              f"{agg.get('output_throughput') or 0:.1f} output tok/s, {took:.1f} s, "
              f"other processes {load['other_cores']} cores, load {load['loadavg_end']}", flush=True)
    print(f"{len(spec)} cells in {time.perf_counter() - t_process:.1f} s (llmserve import "
          f"{t_ready - t_process:.1f} s)", flush=True)
    try:
        ch.check_unchanged(expected_hash, "while the group ran")
    except ch.SourcesChanged as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def finalize(spec: dict[str, str], raw: Path, log_dir: Path, expected_hash: str, device: str,
             exit_status: int, group: str) -> int:
    """Failed reports for the cells the ``run`` step left without a provenance file, and an
    empty trace for every traced cell left without one."""
    for cell, flags in spec.items():
        trace = trace_path(flags)
        if trace is not None and not trace.exists():
            write_empty_trace(trace)
            print(f"{cell}: no trace from the run; empty trace written to {trace}")
    missing = [c for c in spec if not (raw / f"{c}.provenance.json").exists()]
    for cell in missing:
        ch.write_provenance(
            json_path=raw / f"{cell}.json", csv_path=raw / f"{cell}.csv",
            output=raw / f"{cell}.provenance.json", cell=cell, exit_status=exit_status or 1,
            expected_code_hash=expected_hash, log=str(log_dir / f"{cell}.log"), device=device,
            extra={"process": {"group": group, "died": True}})
        print(f"{cell}: no report from the group process (exit status {exit_status}); "
              "failed report written")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cmd", choices=("run", "finalize"))
    p.add_argument("--spec", required=True, help="JSON {cell: flags}, inline or a file")
    p.add_argument("--raw", type=Path, required=True, help="folder of the raw reports")
    p.add_argument("--log-dir", type=Path, required=True, help="folder of the per-cell logs")
    p.add_argument("--code-hash", required=True, help="llmserve code hash the DAG was built with")
    p.add_argument("--device", default="cpu")
    p.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--group", default="", help="group name (recorded in provenance)")
    p.add_argument("--exit-status", type=int, default=0, help="finalize: the run step's status")
    a = p.parse_args(argv)
    spec = load_spec(a.spec)
    if a.cmd == "run":
        return run_group(spec, a.raw, a.log_dir, a.code_hash, a.device, a.torch_threads, a.group)
    return finalize(spec, a.raw, a.log_dir, a.code_hash, a.device, a.exit_status, a.group)


if __name__ == "__main__":
    sys.exit(main())
