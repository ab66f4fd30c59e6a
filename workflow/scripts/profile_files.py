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
        ValueError: ``extends`` names a missing file, or the chain loops back to a file in it.
    """
    path = Path(path)
    if path in seen:
        raise ValueError(f"{path}: 'extends' loops back to itself")
    if not path.exists():
        raise ValueError(f"{seen[-1] if seen else path}: extends {str(path)!r}, which does not exist")
    cfg = yaml.safe_load(path.read_text()) or {}
    base = cfg.pop("extends", None)
    if base is None:
        return cfg
    merged = read_profile(base, (*seen, path))
    merged.update(cfg)
    return merged


def is_profile(path: Path) -> bool:
    """Whether a YAML file under config/ is a matrix profile (it has sweeps or extends one)."""
    cfg = yaml.safe_load(path.read_text()) or {}
    return isinstance(cfg, dict) and ("sweeps" in cfg or "extends" in cfg)
