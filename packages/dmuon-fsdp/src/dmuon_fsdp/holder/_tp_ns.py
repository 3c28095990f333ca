"""Newton–Schulz of a tensor-parallel matrix: every rank of its owner's TP group holds a shard.

[Note: Newton–Schulz under tensor parallelism]

A dedicated TP matrix ``W`` (m × n) is split along ``tp_dim`` into T equal shards, one per rank
of the owner's TP group (see [Note: tensor-parallel grids] in ``topology/_mesh``); the momentum and
the NS input are elementwise, so each rank forms its shard of the input locally. NS needs the
whole matrix, in one of two ways (``StepOptions(tp_ns=...)``):

- ``"gather"``: the group's TP owner (the index the plan gives the matrix, spread over the
  group) gathers the T input shards, runs NS once on the whole matrix and scatters the result:
  NS runs once per matrix in the world, and each shard travels twice: ``2(T−1)/T·m·n``
  elements through the TP owner. The step runs the group's gathered matrices side by side
  (:meth:`TensorParallelNS.stages`, [Note: Newton–Schulz that waits for peers] in
  optim/_muon_math), so each rank's NS work is its own matrices'.
- ``"gram"``: ``dmuon_ns.gram_newton_schulz_distributed`` needs each rank's shard to be a
  *column block* of the matrix it orthogonalises, ``X``. The shard direction alone decides
  ``X``, whatever the aspect ratio: column shards (``Shard(1)``, RowwiseParallel) are column
  blocks of ``X = W``; row shards (``Shard(0)``, ColwiseParallel) are row blocks of ``W``, so
  column blocks of ``X = Wᵀ``, and the result is transposed back (``NS(Wᵀ) = NS(W)ᵀ``). Every
  rank forms its block's ``Xᵢ·Xᵢᵀ`` and one all-reduce of the sums gives every rank the whole
  Gram matrix (one more all-reduce per restart). The Gram side of ``X`` is the dimension the
  shards do not split, so it applies where that is the short side: ``short²`` elements travel
  per all-reduce, but every rank repeats the iterations on the Gram matrix. When the shards
  split the short side the Gram matrix would be ``long × long``, larger than the matrix itself.
- ``"auto"`` (the default) takes ``"gram"`` where it applies (the shards split the long side,
  or either side of a square matrix, and the optimizer's NS is a Gram ``NewtonSchulz``) and
  ``dmuon_ownership.tp_gram_pays`` finds that the bytes it saves outweigh the iterations every
  rank repeats ([Note: gathered or Gram NS of a tensor-parallel matrix] there: very wide
  matrices of modest width, such as a small model's output head), ``"gather"`` otherwise.
  ``"gram"`` takes it wherever it applies, and ``"gather"`` for the other matrices.

Both give each rank its shard of ``NS(input)``; the update and weight decay are elementwise on
the shards. Traffic is counted on the ``tp`` axis of the runtime's byte counter.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from enum import StrEnum

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from dmuon_ns import NewtonSchulz, gram_newton_schulz_distributed
from dmuon_ownership import tp_gram_pays

from .._matrix import NSFunction
from ..topology import Axis, CommCounter, CommKind

__all__ = ["TPMode", "TensorParallelNS"]


class TPMode(StrEnum):
    AUTO = "auto"
    GATHER = "gather"
    GRAM = "gram"


def gram_of(ns: NSFunction) -> NewtonSchulz | None:
    """``ns`` when it is a Gram ``NewtonSchulz``, the one distributed Gram NS can run."""
    return ns if isinstance(ns, NewtonSchulz) and ns.backend == "gram" else None


def gram_applies(shape: tuple[int, int], tp_dim: int, ns: NSFunction) -> bool:
    """Whether distributed Gram NS is worth running on a matrix of ``shape`` split on
    ``tp_dim``: the shards must split the long side (either side of a square matrix), so that
    the Gram side is the short one, and ``ns`` must be a Gram ``NewtonSchulz``."""
    return shape[1 - tp_dim] <= shape[tp_dim] and gram_of(ns) is not None


def choose(
    mode: TPMode, shape: tuple[int, int], tp_dim: int, ns: NSFunction, tp: int, itemsize: int
) -> TPMode:
    """The way a matrix of ``shape`` split over ``tp`` ranks on ``tp_dim`` (its NS input in
    elements of ``itemsize`` bytes) is orthogonalised; see [Note: Newton–Schulz under tensor
    parallelism]."""
    gram = gram_of(ns)
    if gram is None or not gram_applies(shape, tp_dim, ns):
        return TPMode.GATHER
    if mode is TPMode.AUTO:
        short, long = sorted(shape)
        restarts = len(gram.restarts)
        pays = tp_gram_pays(short, long, tp, itemsize=itemsize, steps=gram.steps, restarts=restarts)
        return TPMode.GRAM if pays else TPMode.GATHER
    return mode


class TensorParallelNS:
    """An NS function on a one-matrix ``(1, *local_shape)`` stack of TP shards, for
    ``muon_batch``: it returns this rank's shard of NS of the whole matrix."""

    def __init__(
        self,
        ns: NSFunction,
        *,
        shape: tuple[int, int],
        tp_dim: int,
        mode: TPMode,
        group: ProcessGroup,
        tp_owner: int,
        counter: CommCounter,
    ) -> None:
        self.ns = ns
        self.shape = shape
        self.tp_dim = tp_dim
        self.mode = mode
        self.group = group
        self.tp_owner = tp_owner  # global rank
        self.counter = counter
        self._gram_ns = gram_of(ns)

    def __call__(self, batch: Tensor) -> Tensor:
        stages = self.stages(batch)
        while True:
            try:
                next(stages)
            except StopIteration as done:
                return done.value

    @property
    def staged(self) -> bool:
        """Whether the step should run this NS beside the group's others (gathered)."""
        return self.mode is TPMode.GATHER

    def holds(self, batch: Tensor) -> tuple[int, int]:
        """The rank that holds the whole matrix while it is orthogonalised, and its bytes."""
        size = dist.get_world_size(self.group)
        return self.tp_owner, batch.numel() * batch.element_size() * size

    def stages(self, batch: Tensor) -> Generator[None, None, Tensor]:
        """NS of ``batch`` (a one-matrix ``(1, *local_shape)`` stack of TP shards), pausing
        where it waits for the group: after the gather is issued, after the TP owner's NS,
        after the scatter is issued; returns this rank's shard of the update."""
        assert batch.shape[0] == 1, "tensor-parallel matrices run one at a time"
        if self.mode is TPMode.GRAM:
            return self._gram(batch[0]).unsqueeze(0)
        local = batch[0].contiguous()
        size = dist.get_world_size(self.group)
        owner = dist.get_rank() == self.tp_owner
        nbytes = local.numel() * local.element_size() * size
        self.counter.record(Axis.TP, CommKind.GATHER, nbytes)
        parts = [torch.empty_like(local) for _ in range(size)] if owner else None
        gathered = dist.gather(local, parts, dst=self.tp_owner, group=self.group, async_op=True)
        yield
        chunks = None
        if owner:
            assert parts is not None and gathered is not None
            gathered.wait()
            full = torch.cat(parts, dim=self.tp_dim)
            del parts
            update = self.ns(full.unsqueeze(0))[0]
            chunks = [c.contiguous() for c in update.chunk(size, dim=self.tp_dim)]
        yield
        self.counter.record(Axis.TP, CommKind.SCATTER, nbytes)
        out = torch.empty_like(local)
        scattered = dist.scatter(out, chunks, src=self.tp_owner, group=self.group, async_op=True)
        yield
        assert gathered is not None and scattered is not None
        gathered.wait()
        scattered.wait()
        return out.unsqueeze(0)

    def _gram(self, local: Tensor) -> Tensor:
        def all_reduce(t: Tensor) -> None:
            self.counter.record(Axis.TP, CommKind.ALL_REDUCE, t.numel() * t.element_size())
            dist.all_reduce(t, group=self.group)

        assert self._gram_ns is not None, "choose() takes gram only for a Gram NewtonSchulz"
        return gram_of_shards(local, self.tp_dim, all_reduce, self._gram_ns)


def gram_of_shards(
    local: Tensor, tp_dim: int, all_reduce: Callable[[Tensor], object], ns: NewtonSchulz
) -> Tensor:
    """This rank's shard of ``ns`` applied to the whole matrix whose ``tp_dim`` shards
    (``local``: ``(..., rows, cols)`` of the shard) the ranks of ``all_reduce`` hold, through
    distributed Gram NS; see [Note: Newton–Schulz under tensor parallelism]. Correct for
    either shard direction and any aspect ratio (whether it is worth it: ``gram_applies``)."""
    row_shards = tp_dim == 0
    x = local.mT if row_shards else local  # column blocks of X
    y = gram_newton_schulz_distributed(
        x,
        all_reduce,
        steps=ns.steps,
        coefficients=ns.coefficients,
        restart_iterations=ns.restart_iterations,
        dtype=ns.dtype,
        eps=ns.eps,
    )
    return y.mT if row_shards else y
