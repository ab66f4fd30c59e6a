"""What Triton compiled: the entries of its on-disk kernel cache.

Kept apart from ``triton_kernels`` (which defines the kernels and needs Triton installed) so
that the benchmark runner and the engine's warm-up can count compilations on any install:
Triton is an optional dependency, imported here only to ask where its cache is.
"""

from __future__ import annotations

import json
import os

__all__ = ["triton_cache_entries", "triton_kernel_names"]


def _triton_cache_dir() -> str:
    try:
        from triton import knobs

        return knobs.cache.dir
    except Exception:  # noqa: BLE001 - older Triton: the documented default
        from ..envs import triton_cache_dir
        return triton_cache_dir()


def triton_cache_entries() -> set[str] | None:
    """The entries of Triton's on-disk cache (a directory per compiled kernel variant, plus
    one for Triton's own launcher module): the entries added across a phase are what was
    compiled during it (loads from the cache add nothing). Empty when the directory does not
    exist yet (a cold cache); ``None`` when it cannot be read."""
    try:
        return {e.name for e in os.scandir(_triton_cache_dir()) if e.is_dir()}
    except FileNotFoundError:
        return set()
    except OSError:
        return None


def triton_kernel_names(entries) -> list[str]:
    """Kernel names of cache ``entries`` (from each entry's metadata JSON; ``"?"`` if
    unreadable), sorted."""
    names = []
    for entry in entries:
        name = "?"
        try:
            folder = os.path.join(_triton_cache_dir(), entry)
            for f in os.listdir(folder):
                if f.endswith(".json") and not f.startswith("__grp__"):
                    with open(os.path.join(folder, f)) as fh:
                        name = json.load(fh).get("name", "?")
                    break
        except (OSError, ValueError):
            pass
        names.append(name)
    return sorted(names)
