"""Engine code hash and per-cell provenance for the checkpoint-3 pipeline.

Snakemake's own ``code`` rerun trigger sees a rule's shell command, not the Python package the
command imports, so the Snakefile passes :func:`code_hash` of the ``llmserve`` sources to every
benchmark job as a parameter: any edit of an engine ``.py`` or ``.json`` file (a comment
included) changes
the parameter, and Snakemake's ``params`` trigger reruns every benchmark cell. Touching a file
without changing it reruns nothing (the hash is of contents, not modification times).

Usage::

    python workflow/scripts/code_hash.py                 # print the hash of the imported llmserve
    python workflow/scripts/code_hash.py --list          # the files it covers
    python workflow/scripts/code_hash.py check --expected H   # exit 1 if the sources changed
    python workflow/scripts/code_hash.py provenance --json raw/X.json --csv raw/X.csv \\
        --output raw/X.provenance.json --cell X --exit-status 0 --expected-code-hash H

``check`` runs before ``llmserve benchmark`` in the benchmark rule and ``provenance`` after it;
both fail the job when the sources no longer match the hash the workflow started with (an
engine edited mid-run), so no cell is ever kept that was measured on other code than its
recorded parameters say. ``provenance`` records the cell parameters, the code hash at run time and how the benchmark process ended. If the process died
without writing its report (killed by the outer ``timeout``, the OOM killer, a segfault), it
writes a schema-complete ``status: failed`` report and CSV row in its place, so a crashed cell is
a failed row in the tables instead of a hole that stops the workflow.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

from matrix_columns import parse_cell_id  # noqa: E402  (workflow/scripts/, next to this file)

__all__ = ["package_root", "source_files", "code_hash", "write_provenance", "check_unchanged",
           "SourcesChanged"]

#: Hashed: every Python source of the package (Triton kernels are .py files too) and its JSON
#: data (the tuned launch table ``triton_kernels/gemv_configs.json`` changes what the GPU runs).
SOURCE_SUFFIXES = (".py", ".json")


def package_root() -> Path:
    """Directory of the ``llmserve`` package that ``llmserve`` on PATH imports.

    Found with :func:`importlib.util.find_spec` (which does not execute the package); falls back
    to ``engine/llmserve`` next to this repository's ``workflow/`` folder.

    Raises:
        FileNotFoundError: neither exists.
    """
    spec = importlib.util.find_spec("llmserve")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0]).resolve()
    fallback = Path(__file__).resolve().parents[2] / "engine" / "llmserve"
    if fallback.is_dir():
        return fallback
    raise FileNotFoundError("cannot find the llmserve package: install it (pip install -e .) "
                            f"or run from the repository (looked for {fallback})")


def source_files(root: Path | None = None) -> list[Path]:
    """Sorted source files (:data:`SOURCE_SUFFIXES`) under ``root`` (default
    :func:`package_root`), caches excluded."""
    root = Path(root) if root is not None else package_root()
    files = [p for p in root.rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES
             and "__pycache__" not in p.parts]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def code_hash(root: Path | None = None) -> str:
    """sha256 hex over ``(relative path, sha256 of content)`` of every source file, in path order.

    Renaming, adding, deleting or editing any file (comments included) changes it; mtimes do not.
    """
    root = Path(root) if root is not None else package_root()
    h = hashlib.sha256()
    for p in source_files(root):
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).hexdigest().encode() + b"\n")
    return h.hexdigest()


def _crash_report(json_path: Path, csv_path: Path, exit_status: int, log: str | None,
                  device: str = "cpu") -> str:
    """Write a ``status: failed`` report + CSV row for a benchmark process that left none."""
    if exit_status in (124, 137):
        why = f"killed by the pipeline's outer timeout (exit status {exit_status})"
    elif exit_status > 128:
        why = f"killed by signal {exit_status - 128} (exit status {exit_status}; OOM killer?)"
    else:
        why = f"exited with status {exit_status} without writing its report"
    error = f"BenchmarkProcessDied: llmserve benchmark {why}; see {log or 'the rule log'}"
    try:  # the real schema and writers, so the stub matches every other report
        from llmserve.bench.metrics import aggregate_records
        from llmserve.bench.report import (
            REQUIRED_FIELDS,
            SCHEMA_VERSION,
            append_csv_row,
            csv_row,
            git_info,
            hardware_info,
            package_versions,
            utc_now,
            write_json,
        )
        report = {k: None for k in REQUIRED_FIELDS}
        report.update(schema_version=SCHEMA_VERSION, status="failed", error=error,
                      created_at=utc_now(), git=git_info(), versions=package_versions(),
                      hardware=hardware_info(device), requests=[],
                      aggregates=aggregate_records([], None))
        write_json(json_path, report)
        if csv_path.exists():
            csv_path.unlink()
        append_csv_row(csv_path, csv_row(report, json_path))
    except ImportError:  # llmserve itself is broken: still leave a parseable failed row
        json_path.write_text(json.dumps({"status": "failed", "error": error, "aggregates": {},
                                         "requests": []}, indent=2) + "\n")
        csv_path.write_text("status,error\nfailed," + json.dumps(error) + "\n")
    return error


def write_provenance(*, json_path: Path, csv_path: Path, output: Path, cell: str,
                     exit_status: int, expected_code_hash: str | None, log: str | None,
                     device: str = "cpu", extra: dict | None = None) -> dict:
    """Record a benchmark cell's parameters, code hash and process outcome (see module doc).

    ``extra`` (JSON-able) is merged into the record, e.g. the process that ran the cell.
    """
    crash_error = None
    if not json_path.exists():
        crash_error = _crash_report(json_path, csv_path, exit_status, log, device)
    elif not csv_path.exists():
        from llmserve.bench.report import append_csv_row, csv_row
        append_csv_row(csv_path, csv_row(json.loads(json_path.read_text()), json_path))
    actual = code_hash()
    prov = {
        "cell": cell,
        "params": parse_cell_id(cell),
        "code_hash": actual,
        "code_hash_at_dag_build": expected_code_hash,
        "code_files": len(source_files()),
        "benchmark_exit_status": exit_status,
        "crash_report_written": crash_error is not None,
        # Snakemake sets these to the job's `threads`; torch's intra-op pool follows them.
        "thread_env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")},
        **(extra or {}),
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(prov, indent=2, sort_keys=True) + "\n")
    return prov


class SourcesChanged(RuntimeError):
    """The llmserve sources differ from those the workflow was started with."""


def check_unchanged(expected: str, when: str) -> None:
    """Raise :class:`SourcesChanged` if :func:`code_hash` is no longer ``expected``.

    A cell measured while the engine was being edited would belong to no code version, and its
    recorded parameters (the hash at DAG build) would hide that from later runs; failing the job
    instead makes Snakemake discard its outputs and run it again next time.
    """
    actual = code_hash()
    if actual != expected:
        raise SourcesChanged(
            f"llmserve sources changed {when} (hash when the workflow started {expected[:12]}, "
            f"now {actual[:12]}); this cell is not kept. Run Snakemake again once the sources "
            "are stable: every cell then reruns against the new code.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="list the hashed files instead")
    p.add_argument("--root", type=Path, default=None, help="package directory (default: imported llmserve)")
    sub = p.add_subparsers(dest="cmd")
    pv = sub.add_parser("provenance", help="record one benchmark cell (run after llmserve benchmark)")
    pv.add_argument("--json", type=Path, required=True, help="the cell's report")
    pv.add_argument("--csv", type=Path, required=True, help="the cell's CSV row")
    pv.add_argument("--output", type=Path, required=True, help="provenance JSON to write")
    pv.add_argument("--cell", required=True, help="cell id (the Paramspace wildcard)")
    pv.add_argument("--exit-status", type=int, required=True, help="llmserve benchmark's exit status")
    pv.add_argument("--expected-code-hash", default=None, help="hash the DAG was built with")
    pv.add_argument("--log", default=None, help="log file to cite in a crash report")
    pv.add_argument("--device", default="cpu", help="the cell's --device (for a crash report)")
    ck = sub.add_parser("check", help="exit 1 if the sources no longer hash to --expected")
    ck.add_argument("--expected", required=True)
    a = p.parse_args(argv)
    if a.cmd == "check":
        try:
            check_unchanged(a.expected, "since the workflow started")
        except SourcesChanged as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    if a.cmd == "provenance":
        prov = write_provenance(json_path=a.json, csv_path=a.csv, output=a.output, cell=a.cell,
                                exit_status=a.exit_status, expected_code_hash=a.expected_code_hash,
                                log=a.log, device=a.device)
        print(f"provenance: {a.cell} code {prov['code_hash'][:12]} exit {a.exit_status}"
              + (" (crash report written)" if prov["crash_report_written"] else ""))
        if a.expected_code_hash and prov["code_hash"] != a.expected_code_hash:
            print(f"error: {SourcesChanged.__doc__.strip()} (while this cell ran: started with "
                  f"{a.expected_code_hash[:12]}, now {prov['code_hash'][:12]}); the job fails so "
                  "that Snakemake discards this cell and reruns it.", file=sys.stderr)
            return 1
        return 0
    if a.list:
        root = a.root or package_root()
        for f in source_files(root):
            print(os.path.relpath(f))
        return 0
    print(code_hash(a.root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
