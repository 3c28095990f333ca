"""The Muon phase of ``step()`` replayed from a CUDA graph (``StepOptions(cuda_graph=True)``).

[Note: the graphed Muon phase]
The Muon phase of a step (per NS batch the momentum pass, the NS call and the update pass,
then the momentum of the stacks another replica steps) is a few kernels per batch, each
launched from Python: on a model of many small matrices the host's launches, not the GPU, set
the step's time. With ``cuda_graph`` the phase is captured once in a CUDA graph and each step
replays it, one launch. Everything around it stays as it is: the hooks, the wait for the
reduces, the non-finite decision, AdamW (torch's fused kernel) and the publish.

A replay runs exactly what the capture recorded, so it must find everything where the capture
left it:

- the tensors: each matrix's weight and momentum at the captured addresses, and the layout of
  its gradient. A step's *signature* lists them, with the batches and which items have a
  gradient, how the items group by hyperparameters (not the values), whether the step may be
  skipped and the NS kernel choices (``dmuon_ns.kernel_choices_version``); a step whose
  signature is not the graph's runs eagerly. The gradients themselves move: the runtime
  reduces into fresh buffers, and where the allocator places them changes from one backward
  to the next. So the momentum pass reads each gradient at an offset from a fixed anchor
  tensor, offsets written before each replay with the hyperparameters.
- the hyperparameters: the kernels read them from a device table written before each replay
  ([Note: hyperparameters on the device] in _fused), so a learning-rate schedule never
  invalidates the graph; the skip flag is copied into the graph's own.

A signature is captured at the second step in a row that has it (the first runs eagerly on the
graph's tables: it compiles what a capture may not and makes the offset tables), and replayed
from the third; the capture records and runs nothing, the step's work is the eager run's. The
graph stays until another signature is captured, so a step that differs once (a matrix without
a gradient) runs eagerly and the next one replays again. A capture that fails (CUDA and torch
report that as ``RuntimeError``) is reported once, through ``logging`` and ``warnings``, and
the phase runs eagerly from then on.

The eager runs of a graphed optimizer read their scalars and gradients through the same tables
as the replays, and the scalar table holds the fp32 numbers the scalar arguments round to:
``cuda_graph`` on or off, the bits are the same (``tests/test_cuda_graph.py``, on a GPU).

The cost is memory: the graph keeps the phase's transient memory (the NS stacks and their
workspaces, as large as the largest batch's, up to about four times ``ns_batch_bytes``) in its own
pool from step to step, where the eager phase hands it back to the allocator for the forward
and backward.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from dmuon_ns import kernel_choices_version

from .._profile import no_mark
from .._warnings import warn
from ._fused import kernels_ready, static_tables
from ._muon_math import Batches, MuonItem, StepScalars, grad_matrices, muon_phase, scalar_rows

__all__ = ["GraphedMuonPhase"]

logger = logging.getLogger(__name__)


@functools.cache
def _anchor(device: torch.device, dtype: torch.dtype) -> Tensor:
    """The fixed tensor the graphed momentum pass reads gradients of ``dtype`` from, at an
    offset (made once, outside any capture)."""
    return torch.empty(16, dtype=dtype, device=device)


class _Buffers:
    """What a signature's eager runs and its graph read: the scalar table, the gradients'
    offsets, the skip flag and the offset tables (see [Note: hyperparameters on the device]
    in _fused)."""

    def __init__(
        self, signature: Hashable, parts: Sequence[Sequence[MuonItem]], skip: bool
    ) -> None:
        items = [item for part in parts for item in part]
        device = items[0].buf.device
        self.signature = signature
        self.values = torch.empty((len(items), 3), dtype=torch.float32, device=device)
        self.skip = torch.empty((), dtype=torch.bool, device=device) if skip else None
        self.tables: dict[Any, Tensor] = {}
        self.anchors = {item.grad.dtype: _anchor(device, item.grad.dtype) for item in items}
        # Each gradient matrix's item and its element offset in the item's gradient: fixed by
        # the signature (the gradients' layouts), unlike the gradients' addresses.
        owner: list[int] = []
        within: list[int] = []
        # Where each part (an NS batch or a momentum-only stack, in the phase's order) starts
        # among the items and among the gradient matrices.
        self._starts: list[tuple[int, int]] = []
        first = 0
        for part in parts:
            self._starts.append((first, len(owner)))
            for index, item in enumerate(part, first):
                start, size = item.grad.data_ptr(), item.grad.element_size()
                for matrix in grad_matrices(item):
                    owner.append(index)
                    within.append((matrix.data_ptr() - start) // size)
            first += len(part)
        self._owner = torch.tensor(owner, dtype=torch.int64)
        self._within = torch.tensor(within, dtype=torch.int64)
        self.grad_offsets = torch.empty(len(owner), dtype=torch.int64, device=device)

    def write(self, items: Sequence[MuonItem], skip: Tensor | None) -> Tensor | None:
        """This step's scalars, gradient offsets and skip flag into the buffers; returns the
        flag to pass."""
        host = torch.tensor(scalar_rows(items), dtype=torch.float32)
        self.values.copy_(host, non_blocking=True)
        bases = [
            (item.grad.data_ptr() - self.anchors[item.grad.dtype].data_ptr())
            // item.grad.element_size()
            for item in items
        ]
        offsets = torch.tensor(bases, dtype=torch.int64)[self._owner] + self._within
        self.grad_offsets.copy_(offsets, non_blocking=True)
        if self.skip is None or skip is None:
            return None
        return self.skip.copy_(skip)

    def scalars(self, part: int) -> StepScalars:
        """What the passes of the phase's ``part``-th part read."""
        first, first_matrix = self._starts[part]
        return StepScalars(self.values, self.grad_offsets, self.anchors, first, first_matrix)


class GraphedMuonPhase:
    """See [Note: the graphed Muon phase]."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._graph: torch.cuda.CUDAGraph | None = None
        self._captured: _Buffers | None = None  # what the graph reads
        self._warm: _Buffers | None = None  # the last eager step's, a capture candidate
        self._failed = False
        self.captures = 0
        self.replays = 0

    def run(
        self,
        batches: Batches,
        momentum_parts: Sequence[list[MuonItem]],
        skip: Tensor | None,
        mark: Callable[[str], None],
    ) -> None:
        """This step's Muon phase: replayed, eager on the graph's buffers, or (before the
        fused kernels are compiled, or after a failed capture) eager as without the option."""
        if self._failed or not kernels_ready() or not (batches or momentum_parts):
            muon_phase(batches, momentum_parts, skip, mark)  # nothing to step: nothing to capture
            return
        parts = [items for _, items, _ in batches] + list(momentum_parts)
        items = [item for part in parts for item in part]
        signature = _signature(batches, momentum_parts, skip)
        captured = self._captured
        if self._graph is not None and captured is not None and captured.signature == signature:
            captured.write(items, skip)
            self._graph.replay()
            self.replays += 1
            return
        warm = self._warm
        seen = warm is not None and warm.signature == signature
        if warm is None or not seen:
            warm = self._warm = _Buffers(signature, parts, skip is not None)
        flag = warm.write(items, skip)
        with static_tables(warm.tables):
            muon_phase(batches, momentum_parts, flag, mark, scalars=warm.scalars)
        if seen:
            self._capture(batches, momentum_parts, warm)

    def _capture(
        self, batches: Batches, momentum_parts: Sequence[list[MuonItem]], warm: _Buffers
    ) -> None:
        self._graph = self._captured = None  # the old graph's memory goes first
        graph = torch.cuda.CUDAGraph()
        try:
            with static_tables(warm.tables), torch.cuda.graph(graph):
                muon_phase(batches, momentum_parts, warm.skip, no_mark, scalars=warm.scalars)
        except RuntimeError as err:  # how CUDA reports a capture it cannot make
            self._failed = True
            self._warm = None
            message = (
                f"dmuon: CUDA-graph capture of the Muon phase failed ({type(err).__name__}:"
                f" {err}); the phase runs eagerly from now on"
            )
            logger.warning(message)
            warn(message, RuntimeWarning)
            return
        self._graph, self._captured, self._warm = graph, warm, None
        self.captures += 1


def _signature(
    batches: Batches, momentum_parts: Sequence[list[MuonItem]], skip: Tensor | None
) -> Hashable:
    """What a replay needs unchanged (see [Note: the graphed Muon phase])."""
    parts = [(index, id(ns), _items_signature(items)) for index, items, ns in batches]
    parts += [(-1, 0, _items_signature(items)) for items in momentum_parts]
    return (tuple(parts), skip is None, kernel_choices_version())


def _items_signature(items: Sequence[MuonItem]) -> tuple[Hashable, ...]:
    """Each item's weight and momentum (addresses, dtypes), its gradient's layout (dtype,
    strides, alignment: not its address) and the hyperparameter groups it falls in
    (first-seen indices: the passes launch once per group, whatever the values)."""
    momentum_groups: dict[tuple[float, bool], int] = {}
    update_groups: dict[tuple[float, float, float], int] = {}
    return tuple(
        (
            item.weight.data_ptr(),
            item.buf.data_ptr(),
            item.weight.dtype,
            item.buf.dtype,
            item.grad.dtype,
            item.grad.stride(),
            item.grad.data_ptr() % 16,
            item.nesterov,
            momentum_groups.setdefault((item.momentum, item.nesterov), len(momentum_groups)),
            update_groups.setdefault((item.lr, item.weight_decay, item.scale), len(update_groups)),
        )
        for item in items
    )
