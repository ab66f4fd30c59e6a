"""workflow/scripts/run_cells.py: which cells of one process skip the kernel warm-up."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow" / "scripts"))
run_cells = pytest.importorskip("run_cells")

from llmserve.bench.runner import add_benchmark_args, options_from_args  # noqa: E402


def _opts(flags: str):
    parser = argparse.ArgumentParser()
    add_benchmark_args(parser)
    return options_from_args(parser.parse_args(shlex.split(flags)))


def _fake_cells(monkeypatch, on_cell) -> None:
    """Cells without an engine: ``run_benchmark`` calls ``on_cell(opts)`` and writes a minimal
    report and CSV; the source check passes and provenance is the ``extra`` record alone."""
    import json

    def fake_run(opts, parts_cache=None):
        on_cell(opts)
        report = {"status": "ok", "aggregates": {"output_throughput": 1.0}}
        Path(opts.output).write_text(json.dumps(report))
        Path(opts.csv).write_text("a\n1\n")
        return report, Path(opts.output), Path(opts.csv)

    import llmserve.bench.runner as runner
    monkeypatch.setattr(runner, "run_benchmark", fake_run)
    monkeypatch.setattr(run_cells.ch, "check_unchanged", lambda *a, **k: None)
    monkeypatch.setattr(run_cells.ch, "write_provenance",
                        lambda **kw: Path(kw["output"]).write_text(json.dumps(kw["extra"])))


BASE = "--model tiny --device cpu --attention-backend triton --linear-backend torch"


@pytest.mark.parametrize("other", [
    "--max-num-seqs 64", "--policy sjf", "--num-blocks 256", "--seed 3", "--requests 7",
    "--arrival-rate 32", "--max-num-batched-tokens 4096", "--warmup-requests 1",
])
def test_sizes_seeds_and_workload_share_a_signature(other):
    assert run_cells.kernel_signature(_opts(f"--config continuous {BASE} --max-num-seqs 8")) == \
        run_cells.kernel_signature(_opts(f"--config continuous {BASE} --max-num-seqs 8 {other}"))


@pytest.mark.parametrize("a,b", [
    ("--config continuous", "--config static"),
    ("--linear-backend torch", "--linear-backend triton-int8"),
    ("--prefill-chunk-size 0", "--prefill-chunk-size 512"),
    ("--dtype float32", "--dtype bfloat16"),
    ("", "--json-schema config/structured/records.schema.json"),
])
def test_kernel_choices_change_the_signature(a, b):
    base = BASE.replace("--linear-backend torch", "") if "linear" in a else BASE
    assert run_cells.kernel_signature(_opts(f"{base} {a}")) != run_cells.kernel_signature(_opts(f"{base} {b}"))


def test_each_cell_starts_from_released_device_memory(monkeypatch, tmp_path):
    """Before every cell the previous cell's objects are unfrozen (the engine freezes the
    collector after its warm-up) and collected (and on CUDA the allocator's cache emptied), so each engine sizes its KV cache from the same free memory; the free bytes
    are recorded in the cell's provenance (``None`` off CUDA)."""
    import gc
    import json

    calls = []
    real_collect, real_unfreeze = gc.collect, gc.unfreeze
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect") or real_collect(*a))
    monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze") or real_unfreeze())

    _fake_cells(monkeypatch, lambda opts: calls.append("cell"))
    spec = {f"scheduler~continuous_batch~{b}": BASE + f" --max-num-seqs {b}" for b in (1, 2)}
    assert run_cells.run_group(spec, tmp_path / "raw", tmp_path / "logs", "h", "cpu", 1, "g") == 0
    assert calls == ["unfreeze", "collect", "cell", "unfreeze", "collect", "cell"]
    for cell in spec:
        prov = json.loads((tmp_path / "raw" / f"{cell}.provenance.json").read_text())
        assert prov["process"]["device_free_bytes_at_start"] is None


@pytest.mark.gpu
def test_cells_of_one_process_get_the_same_kv_cache_on_cuda(tmp_path):
    """On a GPU, engines built one after another in one process size their KV caches
    (``gpu_memory_utilization`` of the free memory) from the same free memory: without
    :func:`run_cells.release_device_memory` the second cell got a fraction of the first's
    blocks while the first engine's memory was still held."""
    import json

    profile = Path(__file__).resolve().parents[1] / "config" / "benchmark-lognormal.yaml"
    flags = (f"--model random:qwen2.5-0.5b --device cuda --profile {profile} --requests 4 "
             "--warmup-requests 0 --arrival-rate inf --max-num-seqs 4 --no-progress --seed 0")
    spec = {f"scheduler~continuous_batch~4_rep~{r}": flags for r in (0, 1, 2)}
    code = run_cells.ch.code_hash(run_cells.ch.package_root())
    assert run_cells.run_group(spec, tmp_path / "raw", tmp_path / "logs", code, "cuda", 1, "g") == 0
    blocks, free = [], []
    for cell in spec:
        report = json.loads((tmp_path / "raw" / f"{cell}.json").read_text())
        prov = json.loads((tmp_path / "raw" / f"{cell}.provenance.json").read_text())
        assert report["status"] == "ok", report.get("error")
        blocks.append(report["kv_cache"]["num_total_blocks"])
        free.append(prov["process"]["device_free_bytes_at_start"])
    assert all(isinstance(f, int) and f > 0 for f in free), free
    assert max(blocks) - min(blocks) <= 0.02 * max(blocks), blocks


def test_each_cell_starts_at_the_process_thread_count(tmp_path, monkeypatch):
    """A batch-invariant cell's engine pins torch to one thread; the next cell of the process
    runs (and records) the thread count the process asked for again."""
    import torch

    seen = []

    def cell(opts):
        seen.append((torch.get_num_threads(), opts.torch_threads))
        torch.set_num_threads(1)     # what the mode's engine build does on a CPU

    _fake_cells(monkeypatch, cell)
    before = torch.get_num_threads()
    try:
        spec = {f"scheduler~continuous_batch~8_rep~{r}": BASE + " --max-num-seqs 8" for r in (0, 1)}
        assert run_cells.run_group(spec, tmp_path / "raw", tmp_path / "logs", "h", "cpu", 2, "g") == 0
    finally:
        torch.set_num_threads(before)
    assert seen == [(2, 2), (2, 2)], seen


def test_a_larger_batch_repeats_the_kernel_warm_up(monkeypatch, tmp_path):
    """Cells of one kernel signature skip the warm-up only when an earlier warmed cell's steps
    were at least as large (sequences and step tokens): batch 8 warms, batch 64 warms again,
    then batch 8 and batch 64 skip."""
    seen = []

    _fake_cells(monkeypatch, lambda opts: seen.append((opts.max_num_seqs, opts.kernel_warmup)))
    spec = {f"c{i}": BASE + f" --max-num-seqs {b} --seed {i}" for i, b in enumerate((8, 64, 8, 64))}
    assert run_cells.run_group(spec, tmp_path / "raw", tmp_path / "logs", "h", "cpu", 1, "g") == 0
    assert sorted(seen) == sorted([(8, True), (64, True), (8, False), (64, False)]), seen


def test_covered_needs_both_sizes():
    assert run_cells.covered([(64, 8192)], (8, 8192)) and not run_cells.covered([(8, 8192)], (64, 8192))
    assert not run_cells.covered([(64, 2048)], (64, 8192)) and not run_cells.covered((), (1, 1))
