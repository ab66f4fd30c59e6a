"""Write or check ``sha256sum``-format checksum files for tracked result files.

Usage (from the repository root, as the pipeline runs it)::

    python workflow/scripts/checksums.py write --output checksums/checkpoint3-cpu.sha256 FILE...
    python workflow/scripts/checksums.py check checksums/*.sha256      # == sha256sum -c

Each line is ``<sha256 hex><two spaces><path>`` with the path as given (relative to the
repository root), sorted by path, so ``sha256sum -c checksums/checkpoint3-cpu.sha256`` run from
the repository root verifies every file (GNU coreutils text mode; paths must not contain
newlines or backslashes, which the pipeline's file names never do).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

__all__ = ["sha256_file", "write_checksums", "check_checksums"]


def sha256_file(path: str | os.PathLike, bufsize: int = 1 << 20) -> str:
    """sha256 hex digest of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def write_checksums(files: list[str], output: str | os.PathLike) -> int:
    """Write ``output`` for ``files`` (relative paths, de-duplicated, sorted); returns the count.

    Raises:
        ValueError: a path is absolute, escapes the current directory, or has a character
            that ``sha256sum`` would escape.
        FileNotFoundError: a file is missing.
    """
    rel: set[str] = set()
    for f in files:
        p = Path(f)
        if p.is_absolute() or ".." in p.parts:
            raise ValueError(f"checksummed paths must be relative to the repository root, got {f}")
        if any(c in f for c in "\n\\"):
            raise ValueError(f"path {f!r} contains a newline or backslash; rename it")
        if not p.is_file():
            raise FileNotFoundError(f"cannot checksum {f}: no such file")
        rel.add(p.as_posix())
    lines = [f"{sha256_file(f)}  {f}\n" for f in sorted(rel)]
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(lines), encoding="utf-8")
    return len(lines)


def check_checksums(checksum_files: list[str]) -> list[str]:
    """Problems found (empty when every listed file exists and matches)."""
    problems: list[str] = []
    for cf in checksum_files:
        for n, line in enumerate(Path(cf).read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            digest, sep, path = line.partition("  ")
            if not sep or len(digest) != 64:
                problems.append(f"{cf}:{n}: not a sha256sum line: {line!r}")
            elif not Path(path).is_file():
                problems.append(f"{path}: missing (listed in {cf})")
            elif sha256_file(path) != digest:
                problems.append(f"{path}: checksum differs from {cf}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write a checksum file for FILEs")
    w.add_argument("--output", required=True)
    w.add_argument("files", nargs="+")
    c = sub.add_parser("check", help="verify checksum files (like sha256sum -c)")
    c.add_argument("checksum_files", nargs="+")
    a = p.parse_args(argv)
    if a.cmd == "write":
        n = write_checksums(a.files, a.output)
        print(f"wrote {a.output}: {n} files")
        return 0
    problems = check_checksums(a.checksum_files)
    for msg in problems:
        print(msg, file=sys.stderr)
    print("OK" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
