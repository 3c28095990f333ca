"""Newton–Schulz during backward: ``StepOptions(ns_overlap=True)``.

[Note: Newton–Schulz during backward]
A rank's Newton–Schulz only needs the final gradients of the matrices it owns, and the reduce
that makes a pack's gradients final usually lands while backward is still running through the
earlier layers. With ``ns_overlap`` the step is split in two around that moment:

1. during backward, when the reduce of every matrix of an NS batch has landed (the runtime's
   listener, see [Note: gradients final during backward] in ``runtime/_collectives``), the
   owner forms the batch's NS input (``grad + momentum·buf``, the momentum buffer left as it
   is) and runs its Newton–Schulz: on CUDA on a side stream, which first waits for the work
   issued so far, so backward's kernels go on beside it; on CPU in the hook itself;
2. ``step()`` waits for that stream, then for each batch computed early advances the momentum
   buffers and applies the decay and the update; batches not computed early (a matrix whose
   reduce lands only in the step, a tensor-parallel matrix, an expert stack) run as before.

The batches are the step plan's, so every NS call sees the same stack as without the option,
and the two halves perform the arithmetic of the one-pass kernels exactly (``ns_input_into``
and ``advance_momentum`` in ``_fused``): the result is bit for bit that of
``ns_overlap=False``. A result is used only if everything it was computed from is unchanged at
the step: each gradient and momentum buffer (the same tensor at the same version: torch's
in-place writes bump ``Tensor._version``) and the momentum and Nesterov of its group. A
gradient scaled in place by torch ops after backward, a second backward that adds to the
gradients before the step, a checkpoint loaded into the momentum: each makes the step recompute
that batch, so the option never changes a result, only when it is computed. A write without
torch's count bumps no version: one through ``grad.data`` (the docs tell users to write in
place on the tensor) or a kernel's (a Triton launch). Muon-aware clipping, whose CUDA path
scales the gradients so, gets them through ``Muon.grads_for_clip()`` (``muon_grads_for_clip()``
included), which, for a selection with a Muon gradient, drops every early result and turns the
option off with a warning (a clip needs the global norm, known only after backward, so nothing
can run early). The non-finite skip needs every gradient, so it is decided in the step as
before; a skipped step keeps weights and momentum exactly (the early half wrote neither).

A model's runtime has one listener: the ``Muon`` built last on the model sets its own (or none,
without the option), and holds it only weakly, so that a deleted optimizer is freed with its
early results. An optimizer built before (one rebuilt in its place and not deleted yet, a second
one by mistake) finds at its next step that it no longer listens: it drops what it held, says
so once, and computes NS in the step, the same bits.

The cost is memory: each early result (the orthogonalised update of the batch, in the
momentum's dtype) is kept from its backward to the step, the size of the matrices the rank
owns; without the option a batch's update lives only while its NS runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .._profile import span
from .._warnings import warn
from ..holder import MuonEntry
from ..runtime import GradListener
from ._muon_math import MuonItem, ns_inputs, orthogonalized

__all__ = ["NSOverlap"]

# What an item's early result was computed from: its gradient and momentum buffer (storage,
# shape, version) and its group's momentum and Nesterov.
_Source = tuple[int, int, tuple[int, ...], int, int, float, bool]


def _source(item: MuonItem) -> _Source:
    return (
        item.grad.data_ptr(),
        item.grad._version,
        tuple(item.grad.shape),
        item.buf.data_ptr(),
        item.buf._version,
        item.momentum,
        item.nesterov,
    )


class _Early(NamedTuple):
    sources: list[_Source]
    updates: Tensor  # the batch's NS result, one matrix per row
    # The gradients and buffers it read, held so that no other tensor can take their storage
    # (and so match their addresses and versions) before the step.
    read: list[tuple[Tensor, Tensor]]


class NSOverlap(GradListener):
    """The early half of the Muon step for the batches whose gradients all arrive through
    the runtime's reduces; see [Note: Newton–Schulz during backward].

    Args:
        batches: the step plan's NS batches (entries of one shape and NS function each).
        eligible: whether an entry's NS may run early (a dedicated matrix orthogonalised by
            the optimizer's own, collective-free Newton–Schulz).
        items_of: the step's items of a batch's entries with a gradient, given each group's
            hyperparameters by the group's ``id`` (the optimizer's: states made on first use).
        numbers: each Muon group's hyperparameters as they are now, by the group's ``id``,
            never raising; read at the first early batch of a backward, kept until
            ``end_step``.
        device: where the step runs; a CUDA device gets the side stream.
    """

    def __init__(
        self,
        batches: Sequence[Sequence[MuonEntry]],
        eligible: Callable[[MuonEntry], bool],
        items_of: Callable[[Sequence[MuonEntry], Mapping[int, dict[str, Any]]], list[MuonItem]],
        numbers: Callable[[], Mapping[int, dict[str, Any]]],
        device: torch.device,
    ) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._device = device
        self._batches = [list(batch) for batch in batches]
        self._items_of = items_of
        self._read_numbers = numbers
        self._numbers: Mapping[int, dict[str, Any]] | None = None
        # The holders each early batch waits for, and the early batches of each holder.
        self._holders: dict[int, frozenset[int]] = {}
        self._batches_of: dict[int, list[int]] = {}
        for index, batch in enumerate(self._batches):
            if batch and all(eligible(entry) for entry in batch):
                holders = frozenset(id(entry.holder) for entry in batch)
                self._holders[index] = holders
                for holder in holders:
                    self._batches_of.setdefault(holder, []).append(index)
        self._missing = {index: set(holders) for index, holders in self._holders.items()}
        self._results: dict[int, _Early] = {}
        # Batches whose early result a step used, and those it found stale and recomputed.
        self.used = 0
        self.stale = 0

    def __call__(self, params: Sequence[object]) -> None:
        """The gradients of ``params`` (holders) are final: run every batch they complete."""
        for holder in params:
            for index in self._batches_of.get(id(holder), ()):
                missing = self._missing[index]
                missing.discard(id(holder))
                if not missing:
                    self._missing[index] = set(self._holders[index])
                    self._run(index)

    def _run(self, index: int) -> None:
        self._results.pop(index, None)
        if self._numbers is None:
            self._numbers = self._read_numbers()
        items = self._items_of(self._batches[index], self._numbers)
        if not items:
            return
        ns = self._batches[index][0].ns
        assert ns is not None
        with span("dmuon::ns_overlap"):
            if self.stream is None:
                updates = orthogonalized(ns, ns_inputs(items))
            else:
                self.stream.wait_stream(torch.cuda.current_stream(self._device))
                with torch.cuda.stream(self.stream):
                    updates = orthogonalized(ns, ns_inputs(items))
        read = [(item.grad, item.buf) for item in items]
        self._results[index] = _Early([_source(item) for item in items], updates, read)

    def begin_step(self) -> None:
        """Order the step after every early half (CUDA: the current stream waits for the
        side stream, which also read the gradients the step may free)."""
        if self.stream is not None:
            torch.cuda.current_stream(self._device).wait_stream(self.stream)

    def take(self, index: int, items: Sequence[MuonItem]) -> Tensor | None:
        """The early NS result of plan batch ``index`` if it was computed from exactly
        ``items`` as they are now, else ``None`` (the step computes it)."""
        early = self._results.pop(index, None)
        if early is None:
            return None
        if early.sources != [_source(item) for item in items]:
            self.stale += 1
            return None
        self.used += 1
        if self.stream is not None:
            # Made on the side stream, read and freed on this one.
            early.updates.record_stream(torch.cuda.current_stream(self._device))
        return early.updates

    def stop(self, why: str, advice: str) -> None:
        """Drop every early result and say once why NS no longer runs during backward, and
        what to do (``advice``), at the user's line (see [Note: a warning's line])."""
        self._results.clear()
        warn(
            f"StepOptions(ns_overlap=True) is off from now on: {why}, so Newton–Schulz runs in "
            f"the step, where it sees the final gradients. {advice}",
            RuntimeWarning,
        )

    def end_step(self) -> None:
        """Drop what the step did not use; every batch waits for all its reduces again (also
        at ``zero_grad``: the next backward starts new gradients)."""
        self._results.clear()
        self._numbers = None
        self._missing = {index: set(holders) for index, holders in self._holders.items()}
