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
