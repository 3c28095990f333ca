"""A declared split: how one fused 2-D weight is cut into the matrices Muon orthogonalises
apart (:class:`MatrixSplit`), and the row blocks it gives for a weight's shape
(:class:`RowBlock`).

[Note: declared splits]
A fused projection holds several matrices in one weight: attention's ``[q; k; v]``
(``(q_rows + k_rows + v_rows, hidden)``; with grouped-query attention k and v are smaller
than q), or a dense MLP's ``[gate; up]``. Muon on the fused weight orthogonalises their
concatenation, which is not what it does to the same model with separate modules; so the
fused weight may declare a split, and its owner then orthogonalises each piece on its own:

- ``MatrixSplit(heads=H, kv_heads=K)``: a fused ``[q; k; v]`` projection, rows ``H·d`` of q,
  then ``K·d`` of k, then ``K·d`` of v (``d``, the head size, from ``head_dim`` or the weight's
  rows); three matrices of shapes ``(H·d, in)``, ``(K·d, in)``, ``(K·d, in)``;
- ``per_head=True``: every head's ``d`` rows are a matrix of their own, ``H + 2K`` matrices of
  ``(d, in)``, all one shape;
- ``MatrixSplit(rows=(r0, r1, ...))``: any consecutive row blocks (``[gate; up]`` is
  ``rows=(I, I)``), each a matrix, or with ``head_dim=d, per_head=True`` each cut into
  matrices of ``d`` rows.

The split always takes *consecutive* row blocks, each a view of the weight. A layout that
interleaves q, k and v per head (GPT-NeoX's ``query_key_value``) or per key/value group
(Megatron's ``[q_group; k; v]`` per group) keeps each head's rows together, so its per-head
split is the same matrices whatever the order (``per_head=True``, which only needs every head's
``d`` rows consecutive); its q, k and v as whole matrices are not blocks of rows, and no split
here declares them.

Momentum and weight decay are elementwise, so they act on the whole weight, split or not; the
learning-rate scale is each piece's (Moonlight's ``0.2·√max(m, n)`` of the piece's matrix). The
planner charges a split weight the sum of its pieces' Newton–Schulz costs
(``WorkItem.matrices``), since that is what its owner runs. A model with a split fused weight
then trains bit for bit as the same model with separate modules wherever Newton–Schulz
computes each matrix of a batch apart from the others (the torch kernel does; the two models
batch the pieces with other matrices, on other owners), and where the model computes the same
products in both (``dmuon-fsdp``'s ``tests/test_split.py`` shows both).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ._checks import int_at_least

__all__ = ["MatrixSplit", "RowBlock"]


class RowBlock(NamedTuple):
    """Rows ``[start, stop)`` of a 2-D weight: ``matrices`` matrices of ``rows`` rows each
    (one piece of a declared split)."""

    name: str  # "q", "k", "v", or "rows a:b"
    start: int
    matrices: int
    rows: int

    @property
    def stop(self) -> int:
        return self.start + self.matrices * self.rows


@dataclass(frozen=True)
class MatrixSplit:
    """How a fused 2-D weight is cut into matrices Muon orthogonalises apart (see [Note:
    declared splits]): consecutive row blocks, by attention heads or by rows. Declare it as
    the result of ``dedicate_params``' predicate (``lambda n, p: MatrixSplit(heads=32,
    kv_heads=8) if n.endswith("qkv.weight") else p.ndim == 2``) or as ``param_policy``'s
    ``split`` field; ``dedicate_params`` checks it against the weight's shape.

    ``MatrixSplit(32, 8)`` is a fused ``[q; k; v]`` projection of 32 query and 8 key/value
    heads; the other fields are keywords.

    Args:
        heads: a fused ``[q; k; v]`` projection's query heads, an int >= 1. Give ``heads`` or
            ``rows``, not both.
        kv_heads: its key/value heads (grouped-query attention), an int >= 1 that divides
            ``heads``; ``None``: ``heads`` (multi-head attention). Only with ``heads``.
        head_dim: the rows of one head, an int >= 1; ``None``: the weight's rows divided by
            ``heads + 2·kv_heads``. With ``rows``, only for ``per_head``.
        per_head: ``True``: every head's ``head_dim`` rows are a matrix of their own (with
            ``rows``: every block is cut into matrices of ``head_dim`` rows); ``False``: each
            block (q, k, v) is one matrix. A bool.
        rows: consecutive row blocks, in order, each an int >= 1 (``(I, I)`` for a fused
            ``[gate; up]``); they must add up to the weight's rows.
    """

    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = field(default=None, kw_only=True)
    per_head: bool = field(default=False, kw_only=True)
    rows: tuple[int, ...] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if (self.rows is None) == (self.heads is None):
            raise ValueError(
                "MatrixSplit needs either rows=(...) (consecutive row blocks, e.g. (I, I) for "
                "[gate; up]) or heads=... (a fused [q; k; v] projection, with kv_heads=...), "
                f"not {'both' if self.rows is not None else 'neither'}"
            )
        if not isinstance(self.per_head, bool):
            raise ValueError(f"MatrixSplit.per_head must be True or False, got {self.per_head!r}")
        for name in ("heads", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if value is not None and not int_at_least(value, 1):
                raise ValueError(f"MatrixSplit.{name} must be an int >= 1, got {value!r}")
        if self.rows is not None:
            self._check_rows()
            return
        assert self.heads is not None
        kv_heads = self.heads if self.kv_heads is None else self.kv_heads
        if self.heads % kv_heads:
            raise ValueError(
                f"MatrixSplit: kv_heads={kv_heads} does not divide heads={self.heads}; "
                "grouped-query attention shares each key/value head among an equal group of "
                "query heads (kv_heads=None: as many as heads)"
            )
        object.__setattr__(self, "kv_heads", kv_heads)

    def _check_rows(self) -> None:
        try:
            rows = tuple(self.rows)  # type: ignore[arg-type]
        except TypeError:
            rows = ()
        if not rows or not all(int_at_least(r, 1) for r in rows):
            raise ValueError(
                f"MatrixSplit.rows must be a non-empty sequence of ints >= 1 (consecutive row "
                f"blocks), got {self.rows!r}"
            )
        if self.kv_heads is not None:
            raise ValueError(
                "MatrixSplit: kv_heads goes with heads=... (a fused [q; k; v] projection); "
                "with rows=(...) give the blocks' rows"
            )
        if self.per_head and self.head_dim is None:
            raise ValueError(
                "MatrixSplit(rows=..., per_head=True) needs head_dim=...: the rows of each "
                "matrix the blocks are cut into"
            )
        if self.head_dim is not None and not self.per_head:
            raise ValueError(
                "MatrixSplit(rows=..., head_dim=...) cuts the blocks into heads only with "
                "per_head=True; drop head_dim or add per_head=True"
            )
        if len(rows) == 1 and not self.per_head:
            raise ValueError(
                f"MatrixSplit(rows={rows}) has one block, the whole weight: nothing to split; "
                "give two or more blocks, or per_head=True with head_dim"
            )
        object.__setattr__(self, "rows", rows)

    @classmethod
    def parse(cls, value: object, where: str) -> MatrixSplit | None:
        """``value`` as a split: a :class:`MatrixSplit`, a mapping of its fields (a JSON
        recipe's ``{"heads": 32, "kv_heads": 8}``), or ``None``; raises a ``ValueError`` that
        starts with ``where``."""
        if value is None or isinstance(value, MatrixSplit):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(
                f"{where}: split must be a MatrixSplit or a dict of its fields (rows, heads, "
                f"kv_heads, head_dim, per_head), got {type(value).__name__}"
            )
        fields: dict[str, Any] = dict(value)
        unknown = sorted(set(fields) - {"rows", "heads", "kv_heads", "head_dim", "per_head"})
        if unknown:
            raise ValueError(
                f"{where}: unknown split field(s) {unknown}; a split takes rows, heads, "
                "kv_heads, head_dim and per_head"
            )
        if isinstance(fields.get("rows"), list):
            fields["rows"] = tuple(fields["rows"])
        try:
            return cls(**fields)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None

    def blocks(self, shape: Sequence[int], name: str) -> tuple[RowBlock, ...]:
        """The pieces of a weight of ``shape`` (in row order); raises a ``ValueError`` naming
        ``name`` and the fix when the split does not fit the shape."""
        dims = tuple(int(d) for d in shape)
        if len(dims) != 2:
            raise ValueError(
                f"{name!r} (shape {dims}) has a declared split {self}, but a split cuts the rows "
                "of a 2-D weight (out, in); declare it only for 2-D weights"
            )
        total = dims[0]
        if self.rows is not None:
            return self._row_blocks(total, name)
        heads, kv_heads = self.heads, self.kv_heads
        assert heads is not None and kv_heads is not None
        count = heads + 2 * kv_heads
        if self.head_dim is None:
            if total % count:
                raise ValueError(
                    f"{name!r} has {total} rows, which its declared split's {count} heads "
                    f"(heads + 2·kv_heads = {heads} + 2·{kv_heads}) do not divide: check heads "
                    "and kv_heads against the model, or give head_dim"
                )
            head_dim = total // count
        else:
            head_dim = self.head_dim
            if count * head_dim != total:
                raise ValueError(
                    f"{name!r} has {total} rows, but its declared split's {heads} + 2·"
                    f"{kv_heads} heads of head_dim {head_dim} make {count * head_dim}: check "
                    "heads, kv_heads and head_dim against the model"
                )
        blocks, start = [], 0
        for part, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            if self.per_head:
                block = RowBlock(part, start, n, head_dim)
            else:
                block = RowBlock(part, start, 1, n * head_dim)
            blocks.append(block)
            start = block.stop
        return tuple(blocks)

    def _row_blocks(self, total: int, name: str) -> tuple[RowBlock, ...]:
        rows = self.rows
        assert rows is not None
        if sum(rows) != total:
            raise ValueError(
                f"{name!r} has {total} rows, but its declared split's blocks {rows} add up to "
                f"{sum(rows)}: give blocks that add up to {total}"
            )
        blocks, start = [], 0
        for size in rows:
            label = f"rows {start}:{start + size}"
            if self.per_head:
                assert self.head_dim is not None
                if size % self.head_dim:
                    raise ValueError(
                        f"{name!r}: its declared split's block {label} has {size} rows, which "
                        f"head_dim {self.head_dim} does not divide: give blocks of whole heads"
                    )
                blocks.append(RowBlock(label, start, size // self.head_dim, self.head_dim))
            else:
                blocks.append(RowBlock(label, start, 1, size))
            start += size
        return tuple(blocks)

    def __str__(self) -> str:
        fields = [f"rows={self.rows}"] if self.rows is not None else [f"heads={self.heads}"]
        if self.rows is None and self.kv_heads != self.heads:
            fields.append(f"kv_heads={self.kv_heads}")
        if self.head_dim is not None:
            fields.append(f"head_dim={self.head_dim}")
        if self.per_head:
            fields.append("per_head=True")
        return f"MatrixSplit({', '.join(fields)})"
