"""Per-request timelines: which cells the pipeline traces, the config's checks, the plot script.

The dry runs read the benchmark groups' cell specs (`run_cells.py run --spec '{cell: flags}'`)
and check that `--trace` is on repetition 0 of exactly the cells the profile's `timelines`
lists, with every other flag as the untraced repetitions have it. The plot script is run on a
synthetic trace (a preempted and recomputed request, a rejected one) beside a failed cell.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "workflow" / "scripts"

pytest.importorskip("snakemake")

CPU_TRACED = {
    "scheduler~naive_policy~fcfs_batch~1_chunk~0_linear~torch_attn~torch_rate~inf_blocks~auto_load~default",
    "scheduler~static_policy~fcfs_batch~8_chunk~0_linear~torch_attn~torch_rate~inf_blocks~auto_load~default",
    "scheduler~continuous_policy~fcfs_batch~8_chunk~0_linear~torch_attn~torch_rate~inf_blocks~auto_load~default",
    "scheduler~continuous_policy~fcfs_batch~8_chunk~0_linear~torch_attn~torch_rate~inf_blocks~auto_load~long",
    "scheduler~continuous_policy~fcfs_batch~8_chunk~32_linear~torch_attn~torch_rate~inf_blocks~auto_load~long",
    "scheduler~continuous_policy~fcfs_batch~8_chunk~0_linear~torch_attn~torch_rate~inf_blocks~24_load~default",
}
H200_TRACED = {
    "scheduler~static_policy~fcfs_batch~8_chunk~0_linear~torch_attn~triton_rate~inf_blocks~auto_load~default",
    "scheduler~continuous_policy~fcfs_batch~8_chunk~0_linear~torch_attn~triton_rate~inf_blocks~auto_load~default",
    "scheduler~continuous_policy~fcfs_batch~8_chunk~512_linear~torch_attn~triton_rate~inf_blocks~auto_load~default",
    "scheduler~continuous_policy~fcfs_batch~64_chunk~0_linear~torch_attn~triton_rate~inf_blocks~256_load~default",
    "scheduler~continuous_policy~fcfs_batch~64_chunk~0_linear~torch_attn~triton_rate~inf_blocks~64_load~default",
}


def snakemake(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=cwd, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)


def group_specs(dry_run_output: str) -> dict[str, str]:
    """``{cell id: flags}`` of every benchmark group a `-p` dry run prints."""
    cells: dict[str, str] = {}
    for spec in re.findall(r"run_cells\.py run --spec '(\{.*?\})'", dry_run_output):
        cells.update(json.loads(spec))
    return cells


@pytest.mark.parametrize("profile,traced,timelines", [
    ("cpu", CPU_TRACED, ["batching", "chunked_prefill", "preemption"]),
    ("h200", H200_TRACED, ["batching", "chunked_prefill", "preemption"]),
])
def test_trace_flag_only_on_repetition_0_of_the_listed_cells(profile, traced, timelines):
    r = snakemake("-n", "--nolock", "--forceall", "-p", "results/checkpoint3",
                  "--config", f"profile={profile}")
    assert r.returncode == 0, r.stdout[-3000:]
    specs = group_specs(r.stdout)
    assert len(specs) > 3 * len(traced), len(specs)
    raw = f"results/checkpoint3/{profile}/raw"
    with_trace = {c for c, flags in specs.items() if "--trace" in flags}
    assert with_trace == {f"{c}_rep~0" for c in traced}, sorted(with_trace ^ {f"{c}_rep~0" for c in traced})
    for cell in with_trace:
        flags = specs[cell]
        trace = f" --trace {raw}/{cell}.trace.jsonl.gz"
        assert flags.endswith(trace), flags
        # every other flag is the untraced repetition's
        assert flags[:-len(trace)] == specs[cell.replace("_rep~0", "_rep~1")]
    for name in timelines:   # one plot job a figure, drawing the traces
        assert f"timeline {name} (" in r.stdout, name
    assert r.stdout.count(".trace.jsonl.gz") >= len(traced)


def test_gpu_target_includes_the_timelines():
    r = snakemake("-n", "--nolock", "--forceall", "results/gpu", "--config", "profile=h200",
                  "--resources", "gpu=1")
    assert r.returncode == 0, r.stdout[-3000:]
    stats = r.stdout[r.stdout.index("Job stats"):]
    for name in ("batching", "chunked_prefill", "preemption"):
        assert re.search(rf"^timeline_{name}\s+1$", stats, re.M), (name, stats[:2000])


def test_a_cell_outside_the_matrix_is_refused(tmp_path):
    conf = tmp_path / "tl.yaml"
    base = ("profile: tl\nrepetitions: 1\nextra_loads: {}\nsweeps:\n  main:\n"
            "    - {scheduler: [naive]}\n    - {scheduler: [continuous], batch: [8]}\n")
    conf.write_text(base + "timelines:\n  mine:\n    - {scheduler: continuous, batch: 16}\n")
    r = snakemake("-n", "--nolock", "results/checkpoint3", "--configfile", str(conf))
    assert r.returncode != 0
    assert "timelines: figure 'mine'" in r.stdout and "which no sweep" in r.stdout, r.stdout[-3000:]
    assert "scheduler~continuous_policy~fcfs_batch~16" in r.stdout   # the cell it resolved to
    conf.write_text(base + "timelines:\n  mine:\n    - {scheduler: continuous, batch: 8}\n"
                    "    - {batch: 8}\n")
    r = snakemake("-n", "--nolock", "results/checkpoint3", "--configfile", str(conf))
    assert r.returncode != 0 and "twice" in r.stdout, r.stdout[-3000:]
    conf.write_text(base + "timelines:\n  mine:\n    - {scheduler: continuous, batchsize: 8}\n")
    r = snakemake("-n", "--nolock", "results/checkpoint3", "--configfile", str(conf))
    assert r.returncode != 0 and "batchsize" in r.stdout, r.stdout[-3000:]   # the schema
    # a matrix file without the section traces nothing (never the default profile's cells)
    conf.write_text(base)
    r = snakemake("-n", "--nolock", "--forceall", "-p", "results/checkpoint3", "--configfile", str(conf))
    assert r.returncode == 0 and "--trace" not in r.stdout, r.stdout[-3000:]
    conf.write_text(base + "timelines:\n  mine:\n    - {scheduler: naive}\n    - {}\n")
    r = snakemake("-n", "--nolock", "--forceall", "-p", "results/checkpoint3", "--configfile", str(conf))
    assert r.returncode == 0, r.stdout[-3000:]
    assert "results/checkpoint3/tl/plots/timeline_mine.png" in r.stdout
    traced = {c for c, f in group_specs(r.stdout).items() if "--trace" in f}
    assert traced == {
        "scheduler~naive_policy~fcfs_batch~1_chunk~0_linear~torch_attn~torch_rate~inf_blocks~auto_load~default_rep~0",
        "scheduler~continuous_policy~fcfs_batch~8_chunk~0_linear~torch_attn~torch_rate~inf_blocks~auto_load~default_rep~0",
    }, traced


# ---------------------------------------------------------------------------------------------
# The plot script and run_cells' empty traces
# ---------------------------------------------------------------------------------------------
OK_CELL = "scheduler~continuous_policy~fcfs_batch~8_chunk~0_linear~torch_attn~torch_rate~inf_blocks~24_load~default_rep~0"
FAILED_CELL = "scheduler~static_policy~fcfs_batch~8_chunk~0_linear~torch_attn~torch_rate~inf_blocks~24_load~default_rep~0"
DEFAULTS = {"scheduler": "continuous", "policy": "fcfs", "batch": "8", "chunk": "0",
            "linear": "torch", "attn": "torch", "rate": "inf", "blocks": "auto",
            "load": "default", "invariant": "off"}


def synthetic_events() -> list[dict]:
    """Three requests at t = 0: a short one, one preempted and recomputed, one rejected."""
    ev = [{"t": 0.0, "request_id": f"bench-{i}", "event": "arrived", "prompt_tokens": 16,
           "max_tokens": 4} for i in range(2)]
    ev += [{"t": 0.001, "request_id": f"bench-{i}", "event": "queued"} for i in range(2)]
    ev += [{"t": 0.002, "request_id": "bench-2", "event": "rejected", "reason": "too long"}]
    for rid, prefills, decodes in (("bench-0", [0.01], [0.03, 0.05, 0.07]),
                                   ("bench-1", [0.01, 0.2], [0.03, 0.23, 0.25])):
        ev += [{"t": t, "request_id": rid, "event": "prefill", "step": 1, "tokens": 16, "start": 0,
                "cached_tokens": 0, "recompute": t > 0.1, "batch_size": 2, "batch_tokens": 32}
               for t in prefills]
        ev += [{"t": t, "request_id": rid, "event": "decode", "step": 2, "batch_size": 2,
                "batch_tokens": 2} for t in decodes]
        ev += [{"t": 0.02, "request_id": rid, "event": "first_token"},
               {"t": decodes[-1] + 0.01, "request_id": rid, "event": "finished", "reason": "length",
                "output_tokens": 4}]
    ev.append({"t": 0.05, "request_id": "bench-1", "event": "preempted", "step": 3,
               "reason": "out of KV blocks", "blocks_freed": 2, "tokens_dropped": 18})
    return ev


def write_cell(raw: Path, cell: str, events: list[dict] | None, status: str = "ok",
               error: str | None = None) -> None:
    from llmserve.core.trace import write_trace

    raw.mkdir(parents=True, exist_ok=True)
    (raw / f"{cell}.json").write_text(json.dumps({"status": status, "error": error}))
    (raw / f"{cell}.provenance.json").write_text(json.dumps({"code_hash": "0123456789abcdef" * 4}))
    if events is not None:
        write_trace(raw / f"{cell}.trace.jsonl.gz", events)


def test_plot_renders_a_preemption_a_rejection_and_a_failed_cell(tmp_path):
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(SCRIPTS))
    try:
        import plot_timeline as pt
        import run_cells
    finally:
        sys.path.remove(str(SCRIPTS))
    from llmserve.core.trace import read_trace

    raw = tmp_path / "raw"
    write_cell(raw, OK_CELL, synthetic_events())
    write_cell(raw, FAILED_CELL, None, status="failed", error="RuntimeError: out of memory")
    # the failed cell left no trace: finalize writes an empty one (the job keeps its outputs)
    flags = f"--config static --trace {raw}/{FAILED_CELL}.trace.jsonl.gz"
    assert run_cells.trace_path(flags) == raw / f"{FAILED_CELL}.trace.jsonl.gz"
    assert run_cells.trace_path("--config static") is None
    (raw / f"{FAILED_CELL}.csv").write_text("status\nfailed\n")
    run_cells.finalize({FAILED_CELL: flags}, raw, tmp_path / "logs", "h", "cpu", 0, "g")
    assert read_trace(raw / f"{FAILED_CELL}.trace.jsonl.gz") == []

    ok = pt.load_cell(raw, OK_CELL)
    failed = pt.load_cell(raw, FAILED_CELL)
    assert ok.status == "ok" and failed.status == "failed" and "out of memory" in failed.error
    words = pt.cell_words(OK_CELL, DEFAULTS, {"scheduler"})
    assert words == "continuous batching, max batch 8, 24 KV blocks", words
    title = pt._panel_title(ok, words)
    assert "3 requests, 1 preemption, 1 rejected" in title, title
    assert "FAILED" in pt._panel_title(failed, "static")
    assert pt._request_order(synthetic_events() + [
        {"t": 0.0, "request_id": "bench-10", "event": "arrived"}]) == ["bench-0", "bench-1", "bench-10", "bench-2"]

    out = tmp_path / "plots" / "timeline_test.png"
    assert pt.main(["--profile", "cpu", "--figure", "test", "--defaults", json.dumps(DEFAULTS),
                    "--raw", str(raw), "--cells", OK_CELL, FAILED_CELL, "--output", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a cell whose files are missing altogether is a failed panel, not an error
    missing = pt.load_cell(raw, OK_CELL.replace("blocks~24", "blocks~7"))
    assert missing.status == "failed" and "no readable report" in missing.error
