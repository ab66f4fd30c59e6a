"""The Snakemake command lines the README and docs print parse and plan: each runs as
``snakemake -n`` (a dry run: nothing executes), so a misordered command (a target swallowed by
``--resources``) or a renamed target fails here instead of in a reader's terminal."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Flags that need a cluster or write outside a dry run's reach: their lines are checked for
#: target order only.
NOT_DRY_RUNNABLE = ("--workflow-profile workflow/profiles/slurm", "--report", "--executor")


def snakemake_lines() -> list[tuple[str, str]]:
    """``(file, command)`` for every ``snakemake ...`` command in a code block or inline code."""
    out = []
    for path in DOCS:
        text = path.read_text()
        blocks = re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, flags=re.S)
        inline = re.findall(r"`(snakemake [^`]+)`", text.replace("\n", " "))
        candidates = [line.split("#", 1)[0] for b in blocks for line in b.splitlines()] + inline
        for line in candidates:
            line = re.sub(r"^\s*(pip install [^&]*&&\s*)", "", line.strip())
            line = re.sub(r"^([A-Z_]+=\S+\s+)+", "", line)
            if line.startswith("snakemake ") and "<" not in line and "..." not in line:
                out.append((path.name, " ".join(line.split())))
    return sorted(set(out))


def test_the_docs_print_snakemake_commands():
    assert len(snakemake_lines()) >= 5


@pytest.mark.parametrize("where,line", snakemake_lines())
def test_targets_come_before_resources(where, line):
    """``--resources`` takes every following word as a resource: a target after it is lost."""
    words = shlex.split(line)
    if "--resources" in words:
        after = words[words.index("--resources") + 1:]
        stray = [w for w in after if not w.startswith("-") and "=" not in w]
        assert not stray, f"{where}: '{line}': {stray} after --resources would be read as resources"


@pytest.mark.skipif(shutil.which("snakemake") is None, reason="snakemake is not installed")
@pytest.mark.parametrize("where,line", [x for x in snakemake_lines()
                                        if not any(f in x[1] for f in NOT_DRY_RUNNABLE)])
def test_snakemake_line_dry_runs(where, line):
    words = shlex.split(line)[1:]
    words = [w for w in words if w not in ("--forceall", "--touch")]
    proc = subprocess.run(["snakemake", "-n", *words, "--quiet", "all"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{where}: '{line}' fails a dry run:\n{proc.stderr[-3000:]}"
