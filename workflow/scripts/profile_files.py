"""Reading the pipeline's profile files (config/<profile>.yaml).

A profile file may start from another one with ``extends: config/OTHER.yaml``: the other
file's keys first, then the file's own on top, each top-level key replacing the other's whole
(a mapping is never merged key by key). ``config/h100.yaml`` uses it to run the H200 matrix
under its own results folder.
"""

from __future__ import annotations

from pathlib import Path

import yaml


def read_profile(path: str | Path, seen: tuple[Path, ...] = ()) -> dict:
    """The top-level keys of a profile file, with those of the file it extends underneath.

    Args:
        path: the YAML file, relative to the working directory (the repository root).
        seen: the files that extend this one (to refuse a loop); callers leave it empty.

    Returns:
        The merged mapping, without the ``extends`` key.

    Raises:
        ValueError: the file or one it extends is missing, not valid YAML or not a mapping;
            ``extends`` is not a path; the chain loops back to a file in it.
    """
    path = Path(path)
    where = f"{seen[-1]}: extends" if seen else "profile file"
    if path.resolve() in {p.resolve() for p in seen}:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise ValueError(f"{chain}: 'extends' loops back to a file of its own chain")
    if not path.is_file():
        raise ValueError(f"{where} {str(path)!r}, which does not exist")
    try:
        cfg = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({e})") from None
    cfg = {} if cfg is None else cfg
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: a profile file is a mapping of settings, not a {type(cfg).__name__}")
    base = cfg.pop("extends", None)
    if base is None:
        return cfg
    if not isinstance(base, str):
        raise ValueError(f"{path}: 'extends' names a file (e.g. config/h200.yaml), not {base!r}")
    merged = read_profile(base, (*seen, path))
    merged.update(cfg)
    return merged


def is_profile(path: Path) -> bool:
    """Whether a YAML file under config/ is a matrix profile (it has sweeps or extends one)."""
    try:
        cfg = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        return False
    return isinstance(cfg, dict) and ("sweeps" in cfg or "extends" in cfg)
