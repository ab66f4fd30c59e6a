"""The checkpoint-3 matrix's columns: one table, imported by the rules and every script.

A benchmark cell is one value per column; its id joins ``name~value`` pairs with ``_`` in the
order of :data:`COLUMNS`, then ``rep~N``, e.g.::

    scheduler~continuous_policy~fcfs_batch~8_chunk~0_linear~torch_attn~torch_rate~inf_blocks~auto_load~default_rep~0

Names and values never contain ``_`` or ``~``, so an id parses back exactly
(:func:`parse_cell_id`). A column with an ``omitted`` value is left out of the id at that value,
so adding such a column renamed no existing cell: the batch-invariant mode shows as
``_invariant~on`` only when it is on.

Adding a column (a new pipeline axis): a row here, its values in
``workflow/schemas/config.schema.yaml`` (``$defs``; a test checks both name the same columns),
and, when it maps to no single ``llmserve benchmark`` flag, its case in ``cell_flags``
(``workflow/rules/common.smk``).

Usage: ``import matrix_columns`` from ``workflow/scripts/`` (the scripts' folder is on ``sys.path``
when a script runs; the rule files load it by path). ``python workflow/scripts/matrix_columns.py``
prints the table.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

__all__ = ["Column", "COLUMNS", "COLUMN_NAMES", "OPTIONAL_COLUMNS", "ID_DEFAULTS",
           "parse_cell_id", "cell_params"]


class Column(NamedTuple):
    """One matrix column.

    Attributes:
        name: the column's name in the config (sweeps, defaults), cell ids and tables.
        flag: the ``llmserve benchmark`` flag it sets (``""`` when ``cell_flags`` maps it).
        omitted: the value at which a cell id leaves the column out (``None``: always named).
        missing: the value assumed when an older cell id or provenance file lacks the column.
        help: what the column means, for docs and the printed table.
    """

    name: str
    flag: str
    omitted: str | None
    missing: str | None
    help: str


#: The columns, in cell-id order.
COLUMNS: tuple[Column, ...] = (
    Column("scheduler", "--config", None, None, "naive | paged | static | continuous"),
    Column("policy", "--policy", None, None, "fcfs | sjf | priority"),
    Column("batch", "--max-batch-size", None, None, "max batch size (naive and paged: 1)"),
    Column("chunk", "--prefill-chunk-size", None, None, "prefill chunk in tokens; 0 = off"),
    Column("linear", "--linear-backend", None, None, "torch | int8 | int4 | triton-int8"),
    Column("attn", "--paged-attention-backend", None, None, "torch | triton"),
    Column("rate", "--arrival-rate", None, None,
           "requests/s, 'inf' (all at t = 0) or 'profile' (the load profile's own)"),
    Column("blocks", "--num-blocks", None, None, "KV cache blocks, or 'auto' (memory budget)"),
    Column("load", "--profile", None, "default", "'default' or a key of extra_loads"),
    Column("invariant", "--batch-invariant", "off", "off", "batch-invariant mode: on | off"),
)
COLUMN_NAMES: tuple[str, ...] = tuple(c.name for c in COLUMNS)
#: Columns a cell id leaves out at the given value.
OPTIONAL_COLUMNS: dict[str, str] = {c.name: c.omitted for c in COLUMNS if c.omitted is not None}
#: A column's value when a cell id or provenance file does not name it.
ID_DEFAULTS: dict[str, str] = {c.name: c.missing for c in COLUMNS if c.missing is not None}


def parse_cell_id(cell: str) -> dict[str, str]:
    """``scheduler~continuous_policy~fcfs_...`` -> ``{"scheduler": "continuous", ...}``.

    Only the parts the id names (``rep`` included); :func:`cell_params` adds the others.

    Raises:
        ValueError: a part is not ``key~value``.
    """
    out: dict[str, str] = {}
    for part in cell.split("_"):
        key, sep, value = part.partition("~")
        if not sep:
            raise ValueError(f"cell id {cell!r}: part {part!r} is not key~value")
        out[key] = value
    return out


def cell_params(cell: str) -> dict[str, str]:
    """Every column's value of a cell id (:data:`ID_DEFAULTS` for the ones it leaves out)."""
    return {**ID_DEFAULTS, **parse_cell_id(cell)}


def main() -> int:
    """Print the column table."""
    width = max(len(c.name) for c in COLUMNS)
    for c in COLUMNS:
        extra = f" (left out of ids at {c.omitted})" if c.omitted is not None else ""
        print(f"{c.name:<{width}}  {c.flag:<26} {c.help}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
