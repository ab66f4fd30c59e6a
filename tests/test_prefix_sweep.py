"""workflow/scripts/prefix_sweep.py: the prefix sweep's table over repetitions (median
[min–max], the CV of p50 TTFT and its noisy mark, a single run shown as it is)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow" / "scripts"))
prefix_sweep = pytest.importorskip("prefix_sweep")

HASH = "ab" * 32


def _write(raw: Path, workload: str, caching: str, rate: float, rep: int, ttft_p50: float,
           status: str = "ok", position: int | None = None, group: int = 2,
           process: str | None = None, invariant: bool = False, digest: str = "d" * 64) -> None:
    mode = "_invariant~on" if invariant else ""
    cell = f"workload~{workload}_caching~{caching}_rate~{rate:g}{mode}_rep~{rep}"
    agg = {"num_requests": 8, "num_completed": 8, "ttft_ms_p50": ttft_p50, "ttft_ms_p95": 2 * ttft_p50,
           "ttft_ms_p99": 3 * ttft_p50, "tpot_ms_p50": 10.0, "output_throughput": 40.0,
           "prefix_cache_hit_rate": 0.5 if caching == "on" else 0.0,
           "prefix_cache_queries": 100, "prefix_cache_hits": 50 if caching == "on" else 0,
           "prefix_cache_cached_blocks": 4, "prefix_cache_evicted_blocks": 0}
    report = {"status": status, "error": None if status == "ok" else "boom",
              "config": {"model": "tiny", "device": "cpu", "requests": 8},
              "hardware": {"cpu_model": "test CPU", "cpu_count": 2}, "profile_path": "p.yaml",
              "aggregates": agg if status == "ok" else {}, "token_digest": digest,
              "requests": [{"ttft_ms": ttft_p50}, {"ttft_ms": 2 * ttft_p50}]}
    (raw / f"{cell}.json").write_text(json.dumps(report))
    prov = {"cell": cell, "code_hash": HASH}
    if position is not None:
        prov["process"] = {"position": position, "cells_in_group": group, "group": process}
    (raw / f"{cell}.provenance.json").write_text(json.dumps(prov))


def _table(tmp_path: Path) -> tuple[str, str]:
    files = sorted((tmp_path / "raw").glob("*_rep~*[0-9].json"))
    prefix_sweep.report(tmp_path / "out", files)
    return (tmp_path / "out" / "table.md").read_text(), (tmp_path / "out" / "table.csv").read_text()


def test_repetitions_fold_into_median_min_max_and_a_noisy_cv(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    for rep, ttft in enumerate((10.0, 20.0, 30.0)):      # CV 41%: noisy
        _write(raw, "multi-turn", "on", 2, rep, ttft)
    for rep, ttft in enumerate((10.0, 10.5, 10.2)):      # CV 2%
        _write(raw, "multi-turn", "off", 2, rep, ttft)
    md, csv = _table(tmp_path)
    on = next(line for line in md.splitlines() if line.startswith("| multi-turn | on "))
    off = next(line for line in md.splitlines() if line.startswith("| multi-turn | off "))
    assert "| 3/3 | 20.0 [10.0–30.0] | 41% noisy |" in on
    assert "| 0.500 [0.500–0.500] |" in on
    assert "noisy" not in off and "| 2% |" in off
    assert f"`{HASH[:16]}`" in md and "3 repetitions" in md
    assert (tmp_path / "out" / "plots" / "ttft_cdf.png").is_file()
    header, *rows = csv.splitlines()
    cols = header.split(",")
    on_row = dict(zip(cols, next(r for r in rows if r.startswith("multi-turn,on,")).split(",")))
    assert on_row["ttft_p50_ms_median"] == "20" and on_row["noisy"] == "true"
    assert on_row["code_hashes"] == HASH


def test_one_repetition_shows_the_run_without_a_spread(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    _write(raw, "shared-prefix", "on", 8, 0, 12.0)
    _write(raw, "shared-prefix", "off", 8, 0, 0.0, status="failed")
    md, _ = _table(tmp_path)
    on = next(line for line in md.splitlines() if line.startswith("| shared-prefix | on "))
    off = next(line for line in md.splitlines() if line.startswith("| shared-prefix | off "))
    assert "| 1/1 | 12.0 | 1 run |" in on and "[" not in on
    assert "| 0/1 | – | 1 run |" in off and "failed: boom" in off


def test_caching_effect_table_gives_off_over_on_ratios(tmp_path):
    """The "Caching on against off" section: p50 TTFT off / on and throughput on / off from the
    medians, one row per workload and rate, a rate of inf included; a failed side shows a dash."""
    raw = tmp_path / "raw"
    raw.mkdir()
    for rep in range(3):
        _write(raw, "multi-turn", "on", float("inf"), rep, 5.0)
        _write(raw, "multi-turn", "off", float("inf"), rep, 20.0)
        _write(raw, "single-turn", "on", 32, rep, 10.0)
    _write(raw, "single-turn", "off", 32, 0, 0.0, status="failed")
    md, _ = _table(tmp_path)
    section = md.split("## Caching on against off", 1)[1]
    assert "| multi-turn | inf | 0.500 | 4.00x | 4.00x | 1.00x | yes |" in section
    assert "| single-turn | 32 | 0.500 | – | – | – | – |" in section
    assert "On the CPU's readable path caching on and off agree." in md


def test_order_shows_each_cell_place_in_its_process(tmp_path):
    """The order column: a cell's place among its process's cells (from the provenance), the
    places of every repetition when they differ, a dash where the provenance has none."""
    raw = tmp_path / "raw"
    raw.mkdir()
    for rep in range(2):
        _write(raw, "single-turn", "on", float("inf"), rep, 9.0, position=0)
        _write(raw, "single-turn", "off", float("inf"), rep, 6.0, position=1 - rep)
    _write(raw, "multi-turn", "on", 2, 0, 5.0)
    for rep, place in enumerate((9, 1)):                 # "10 of 12" sorts after "2 of 12"
        _write(raw, "shared-prefix", "on", 8, rep, 5.0, position=place, group=12)
    md, csv = _table(tmp_path)
    lines = md.splitlines()
    assert any(line.startswith("| single-turn | on | inf | 1 of 2 | 2/2 |") for line in lines), md
    assert any(line.startswith("| single-turn | off | inf | 1 of 2 / 2 of 2 | 2/2 |") for line in lines), md
    assert any(line.startswith("| multi-turn | on | 2 | – | 1/1 |") for line in lines), md
    assert any(line.startswith("| shared-prefix | on | 8 | 2 of 12 / 10 of 12 | 2/2 |") for line in lines), md
    assert csv.splitlines()[0].split(",")[:5] == ["workload", "caching", "arrival_rate", "batch_invariant", "order"]


def test_header_says_whether_the_repetitions_shared_a_process(tmp_path):
    """The table says "one process each" when the repetitions ran in their own processes and
    "all in one process" when one process ran them all (`group_cells_by: all`)."""
    raw = tmp_path / "raw"
    raw.mkdir()
    for rep in range(2):
        _write(raw, "single-turn", "on", float("inf"), rep, 9.0, position=rep, process=f"prefix_rep{rep}")
    assert "2 repetitions, one process each" in _table(tmp_path)[0]
    for rep in range(2):
        _write(raw, "single-turn", "on", float("inf"), rep, 9.0, position=rep, process="prefix_all")
    md = _table(tmp_path)[0]
    assert "2 repetitions, all in one process" in md and "one process each" not in md


def test_batch_invariant_check_rows_fold_apart_and_compare_outputs(tmp_path):
    """Cells of the batch-invariant check (``_invariant~on`` in the id) are rows of their own,
    marked in the workload column, after the sweep's rows; the on/off section pairs them with
    each other, and "same outputs" reads no where caching on and off generated other tokens (or
    repetitions disagree), yes where one digest is shared."""
    raw = tmp_path / "raw"
    raw.mkdir()
    for rep in range(2):
        _write(raw, "multi-turn", "on", float("inf"), rep, 5.0, digest=f"{rep}" * 64)  # runs disagree
        _write(raw, "multi-turn", "off", float("inf"), rep, 20.0)
    _write(raw, "multi-turn", "on", float("inf"), 0, 8.0, invariant=True, digest="e" * 64)
    _write(raw, "multi-turn", "off", float("inf"), 0, 24.0, invariant=True, digest="e" * 64)
    md, csv = _table(tmp_path)
    table, section = md.split("## Caching on against off", 1)
    lines = [line for line in table.splitlines() if line.startswith("| multi-turn")]
    assert [line.split(" | ")[:2] for line in lines] == [
        ["| multi-turn", "on"], ["| multi-turn", "off"],
        ["| multi-turn, `--batch-invariant`", "on"], ["| multi-turn, `--batch-invariant`", "off"]], lines
    assert "| 1/1 | 8.0 | 1 run |" in lines[2]
    assert "| multi-turn | inf | 0.500 | 4.00x | 4.00x | 1.00x | no |" in section
    assert "| multi-turn, `--batch-invariant` | inf | 0.500 | 3.00x | 3.00x | 1.00x | yes |" in section
    header, *rows = csv.splitlines()
    flags = [dict(zip(header.split(","), r.split(",")))["batch_invariant"] for r in rows]
    assert flags == ["false", "false", "true", "true"], flags


def test_same_outputs_needs_every_repetition(tmp_path):
    """"same outputs" is a dash when a repetition of either side failed (its tokens are
    unknown), and the plots still render when only check cells exist."""
    raw = tmp_path / "raw"
    raw.mkdir()
    _write(raw, "multi-turn", "on", 4, 0, 5.0, invariant=True)
    _write(raw, "multi-turn", "on", 4, 1, 5.0, invariant=True, status="failed")
    _write(raw, "multi-turn", "off", 4, 0, 9.0, invariant=True)
    _write(raw, "multi-turn", "off", 4, 1, 9.0, invariant=True)
    md, _ = _table(tmp_path)
    assert "| multi-turn, `--batch-invariant` | 4 | 0.500 | 1.80x | 1.80x | 1.00x | – |" in md, md
    assert (tmp_path / "out" / "plots" / "ttft_cdf.png").stat().st_size > 1000
    assert (tmp_path / "out" / "plots" / "hit_rate.png").is_file()
