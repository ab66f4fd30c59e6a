"""The checkpoint-3 matrix's columns: one table, imported by the rules and every script.

A benchmark cell is one value per column; its id joins ``name~value`` pairs with ``_`` in the
order of :data:`COLUMNS`, then ``rep~N``, e.g.::

    scheduler~continuous_policy~fcfs_batch~8_chunk~0_linear~torch_attn~torch_rate~inf_blocks~auto_load~default_rep~0

Names and values never contain ``_`` or ``~``, so an id parses back exactly
(:func:`parse_cell_id`). A column with an ``omitted`` value is left out of the id at that value,
so adding such a column renamed no existing cell: the batch-invariant mode shows as
``_invariant~on`` only when it is on.

Every column sets one ``llmserve benchmark`` flag (:func:`column_flag`): ``--flag value``, or
the bare ``--flag`` of a switch at ``on``, and none at the value where the benchmark's own
default applies (``unflagged``). ``cell_flags`` (``workflow/rules/common.smk``) writes a cell's
flags from this table.

Adding a column (a new pipeline axis): a row here, its values in
``workflow/schemas/config.schema.yaml`` (``$defs``, the cell and the sweep block; a test checks
they name the same columns) and the values to sweep in the profile's config (``config/``; a
column without an ``omitted`` value needs its default there too).

Usage: ``import matrix_columns`` from ``workflow/scripts/`` (the scripts' folder is on ``sys.path``
when a script runs; the rule files load it by path). ``python workflow/scripts/matrix_columns.py``
prints the table.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

__all__ = ["Column", "COLUMNS", "COLUMN_NAMES", "OPTIONAL_COLUMNS", "ID_DEFAULTS", "FLAG_ORDER",
           "parse_cell_id", "cell_params", "column_flag", "columns_in_flag_order"]


class Column(NamedTuple):
    """One matrix column.

    Attributes:
        name: the column's name in the config (sweeps, defaults), cell ids and tables.
        flag: the ``llmserve benchmark`` flag it sets.
        omitted: the value at which a cell id leaves the column out (``None``: always named).
        missing: the value assumed when an older cell id or provenance file lacks the column.
        help: what the column means, for docs and the printed table.
        unflagged: the value at which the flag is not passed (the benchmark's own default
            applies; ``None``: always passed).
        switch: the flag takes no value: passed alone at ``on`` (``off`` should be
            ``unflagged``).
    """

    name: str
    flag: str
    omitted: str | None
    missing: str | None
    help: str
    unflagged: str | None = None
    switch: bool = False


#: The columns, in cell-id order.
COLUMNS: tuple[Column, ...] = (
    Column("scheduler", "--config", None, None, "naive | paged | static | continuous"),
    Column("policy", "--policy", None, None, "fcfs | sjf | priority"),
    Column("batch", "--max-batch-size", None, None, "max batch size (naive and paged: 1)"),
    Column("chunk", "--prefill-chunk-size", None, None, "prefill chunk in tokens; 0 = off"),
    Column("linear", "--linear-backend", None, None, "torch | int8 | int4 | triton-int8"),
    Column("attn", "--paged-attention-backend", None, None, "torch | triton"),
    Column("rate", "--arrival-rate", None, None,
           "requests/s, 'inf' (all at t = 0) or 'profile' (the load profile's own)", unflagged="profile"),
    Column("blocks", "--num-blocks", None, None, "KV cache blocks, or 'auto' (memory budget)",
           unflagged="auto"),
    Column("load", "--profile", None, "default", "'default' or a key of extra_loads (its profile file)"),
    Column("invariant", "--batch-invariant", "off", "off", "batch-invariant mode: on | off",
           unflagged="off", switch=True),
)
COLUMN_NAMES: tuple[str, ...] = tuple(c.name for c in COLUMNS)
#: The columns a focused table or plot holds at their defaults: all but the two it compares
#: (the scheduler and the max batch size).
SLICE_COLUMNS: tuple[str, ...] = tuple(c for c in COLUMN_NAMES if c not in ("scheduler", "batch"))
#: Columns a cell id leaves out at the given value.
OPTIONAL_COLUMNS: dict[str, str] = {c.name: c.omitted for c in COLUMNS if c.omitted is not None}
#: A column's value when a cell id or provenance file does not name it.
ID_DEFAULTS: dict[str, str] = {c.name: c.missing for c in COLUMNS if c.missing is not None}
#: The order of the columns' flags in a cell's flag string, the one it has always had (the
#: string is a parameter of the benchmark jobs: another order would rerun every cell). A column
#: not named here comes after these, in column order.
FLAG_ORDER: tuple[str, ...] = ("scheduler", "policy", "batch", "chunk", "linear", "attn", "load",
                               "invariant", "rate", "blocks")


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


def columns_in_flag_order() -> list[Column]:
    """Every column, in the order of its flag in a cell's flag string (:data:`FLAG_ORDER`)."""
    rank = {name: i for i, name in enumerate(FLAG_ORDER)}
    return sorted(COLUMNS, key=lambda c: (rank.get(c.name, len(rank)), COLUMN_NAMES.index(c.name)))


def column_flag(column: Column, value: str) -> str | None:
    """The ``llmserve benchmark`` flag of ``column`` at ``value`` (a cell's value; the load
    column is given its profile file), or None when none is passed.

    Raises:
        ValueError: a switch at a value other than ``on`` and its ``unflagged`` one.
    """
    if value == column.unflagged:
        return None
    if column.switch:
        if value != "on":
            raise ValueError(f"column {column.name!r} is a switch (on | {column.unflagged}), got {value!r}")
        return column.flag
    return f"{column.flag} {value}"


def main() -> int:
    """Print the column table."""
    width = max(len(c.name) for c in COLUMNS)
    for c in COLUMNS:
        extra = f" (left out of ids at {c.omitted})" if c.omitted is not None else ""
        if c.unflagged is not None:
            extra += f" (no flag at {c.unflagged})"
        print(f"{c.name:<{width}}  {c.flag:<26} {c.help}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
