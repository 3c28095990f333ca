"""Measured kernel timings shipped with the package, so that common shapes need no tuning.

[Note: shipped tables]
A table is one JSON file in ``dmuon_ns/tables/``, written by ``benchmarks/ns_tables.py`` on
the card it names: for each problem (op, batch, m, n, iteration dtype) the median time of every
kernel that passed the autotuner's cross-check there, and the kernels it rejected, with the
date and the versions it was measured with. ``auto`` reads the table of the device it runs
on (by ``torch.cuda.get_device_name``) and runs the fastest kernel of the entry among its
candidates, from the problem's first call, as it would a verdict it measured itself
(``_autotune``'s [Note: where a verdict comes from]).

An entry answers for a problem when it is of the same op, m, n and dtype, its batch is the
nearest measured one (by ratio; ties to the smaller), and it covers every candidate (a time or
a rejection for each): a kernel it never saw, such as a registered one, was never compared,
and the problem is left to the autotuner. The coefficient values, the number of steps and
the restarts are not part of the key: the products of a call do not depend on the
coefficients, and more steps or restarts add the same products to every kernel. Nor are the
versions: a table measured under other versions still ranks the same products;
``NewtonSchulz.tune`` measures on the machine itself where that is in doubt, and its verdict
(kept in the on-disk cache) comes first.

Only cards that were measured have a table: the H200 and the H100 80GB HBM3 (SXM), each
named as ``torch.cuda.get_device_name`` reports it. No other card's numbers are written down,
estimated or carried over (an H100 PCIe or NVL reports another name and gets none).
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

__all__ = ["FORMAT_VERSION", "TableEntry", "entry_for", "load", "table_file", "verdict_kernel"]

FORMAT_VERSION = 1
_TABLES = {"NVIDIA H200": "nvidia-h200.json", "NVIDIA H100 80GB HBM3": "nvidia-h100.json"}


class TableEntry(NamedTuple):
    """One measured problem: each passing kernel's median ms and the rejected kernels."""

    op: str
    batch: int
    m: int
    n: int
    dtype: str
    ms: dict[str, float]
    rejected: dict[str, str]


def table_file(device_name: str) -> str | None:
    """The file name of ``device_name``'s table, or ``None`` when that card has none."""
    return _TABLES.get(device_name)


@functools.cache
def load(device_name: str) -> tuple[TableEntry, ...]:
    """Every entry of ``device_name``'s table (none for a card without one)."""
    name = table_file(device_name)
    if name is None:
        return ()
    text = importlib.resources.files("dmuon_ns").joinpath("tables", name).read_text("utf-8")
    return parse(json.loads(text), name)


def parse(data: Any, where: str) -> tuple[TableEntry, ...]:
    """The entries of a table's JSON object; ``ValueError`` naming ``where`` when malformed."""
    if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
        raise ValueError(f"{where}: not a format-{FORMAT_VERSION} dmuon-ns kernel table")
    entries = []
    for row in data.get("problems", []):
        try:
            entries.append(
                TableEntry(
                    str(row["op"]),
                    int(row["batch"]),
                    int(row["m"]),
                    int(row["n"]),
                    str(row["dtype"]),
                    {str(k): float(v) for k, v in row["ms"].items()},
                    {str(k): str(v) for k, v in row.get("rejected", {}).items()},
                )
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"{where}: malformed problem {row!r} ({err})") from err
    return tuple(entries)


def entry_for(
    entries: Sequence[TableEntry], op: str, batch: int, m: int, n: int, dtype: str
) -> TableEntry | None:
    """The entry that answers for the problem (see the note), or ``None``."""
    same = [e for e in entries if (e.op, e.m, e.n, e.dtype) == (op, m, n, dtype)]
    if not same:
        return None
    return min(same, key=lambda e: (abs(math.log(e.batch / batch)), e.batch))


def verdict_kernel(entry: TableEntry, candidates: Sequence[str]) -> str | None:
    """The fastest of ``candidates`` in ``entry`` (ties: the earlier candidate), or ``None``
    when the entry does not cover every candidate or none of them passed."""
    if any(name not in entry.ms and name not in entry.rejected for name in candidates):
        return None
    timed = [name for name in candidates if name in entry.ms]
    if not timed:
        return None
    return min(timed, key=lambda name: entry.ms[name])
