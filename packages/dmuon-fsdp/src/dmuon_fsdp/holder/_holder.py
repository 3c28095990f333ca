"""What every holder is: its state on this rank, the transitions between states, and the step
view it hands to the optimizer.

[Note: parameter holders]
Every parameter dmuon takes over has one *holder* on each rank, as FSDP2 gives each of its
parameters an ``FSDPParam``: the one object that owns the parameter's state here and answers
what the runtime, the step and the checkpoints ask of it, so that none of them asks what kind
of parameter it is. A kind is a holder class (see [Note: the kinds of holders] in
:mod:`._kinds`); ``dedicate_params`` asks the registry once per selected parameter which kind
it is and builds its holder once the owner plan is made. The verbs, by who calls them:

- the packs (``runtime/_pack``): ``place`` (the weight moves into its slot of a pack buffer),
  ``hold`` and ``release`` (a peer's storage comes and goes around its layer's forward and
  backward);
- the collectives: ``take_local_grad`` and ``accumulate_grad``, the two ends of a gradient's
  way to its owner, which also record whether the parameter got one this step (see [Note: a
  parameter without a gradient] in ``runtime/_collectives``); before them, the gradient hook
  of a backward under ``no_sync``: ``widen_local_grad`` (see [Note: accumulating in the reduce
  dtype] in :mod:`._precision`);
- the group's publish: ``receive`` and ``landed`` (a copy being sent, or overwritten by its
  owner's);
- the step plan (``optim/_step_plan``): ``muon_entries``, the holder's step view (the tensors
  the Muon step reads and writes, its matrices, and how its Newton–Schulz runs: batched with
  its shape, through its own function, or not at all when only its momentum advances here;
  one entry per piece of a declared split, see [Note: what Muon steps] in ``_matrix``),
  ``step_tensors``, ``weight_part`` (the post-update hook), ``clip_grad`` (dmuon-clip) and
  ``publish`` (after the post-update hooks, for kinds whose update reaches other ranks in the
  step);
- checkpoints read ``full``, ``grad``, ``shape``, ``tp_dim`` and ``local_part`` of the
  dedicated kinds.

[Note: a holder's states]
A holder's :class:`HolderState` says what this rank holds of the weight, and the parameter's
class follows it (its holder switches it, see [Note: reads on a peer] in :mod:`._guard` and
[Note: reads before a publish lands] in :mod:`._pending`)::

                 place (kept here)              receive
      UNPLACED ─────────────────────► HELD ─────────────► RECEIVING
          │   ◄──── drop_storage ────  │ ▲  ◄─────────────
          │                   release  │ │ hold    landed
          │  place (a peer)            ▼ │
          └──────────────────────► RELEASED

- ``HELD``: this rank holds the current weight (an owner and its replicas always; a peer from
  its boundary's broadcast to its reshard); a plain ``nn.Parameter`` (``DTensor``);
- ``RELEASED``: packed, and this rank holds no storage for it (a peer between uses); guarded:
  a read raises :class:`NotHeldError` with the holder's ``not_held_message``;
- ``UNPLACED``: no place in a pack yet and no storage (a peer's weight that ``to_empty``
  materialised before packing); guarded, and in-place writes go to a scratch tensor;
- ``RECEIVING``: a publish is in flight from (the owner) or into (a replica) this rank's
  copy; an operation on its values (a read, or a write the publish could read) waits for it.

The states are those of the dedicated kinds (``DedicatedParam`` and its subclasses); a kind
FSDP2 holds has none, FSDP2 moves its storage. Every change goes through a ``to_<state>()``
method of ``DedicatedParam`` that asserts the states it leaves; the verbs the runtime calls
(``place``, ``hold``, ``release``, ``drop_storage``, ``receive``, ``landed``) are safe in any
state, as the group's are.
"""

from __future__ import annotations

from collections.abc import Hashable
from enum import Enum, StrEnum, auto
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from dmuon_ownership import MatrixSplit, Plan, ResolvedPolicy, Route

from .._matrix import LrScaling, MatrixView, NSFunction
from ..topology import DedicatedCommContext, MeshLayout
from ._tp_ns import TPMode

__all__ = [
    "Found",
    "HolderState",
    "MuonEntry",
    "ParamHolder",
    "Role",
    "StepContext",
    "WeightPart",
]


class Role(StrEnum):
    """This rank's relation to a parameter."""

    OWNER = "owner"  # the global owner: authoritative weight, gradient, optimizer step
    REPLICA = "replica"  # HSDP: same shard column as the owner; keeps a published copy
    PEER = "peer"  # receives the weight for forward/backward, holds nothing in between


class HolderState(Enum):
    """What this rank holds of a parameter's weight; see [Note: a holder's states]."""

    UNPLACED = auto()
    RELEASED = auto()
    HELD = auto()
    RECEIVING = auto()


class Found(NamedTuple):
    """A parameter ``dedicate_params`` selected, as the kinds' ``claims`` see it."""

    fqn: str
    param: nn.Parameter
    module: nn.Module  # the module that registers it
    name: str  # its attribute name on ``module``
    policy: ResolvedPolicy
    # The split declared for it (by the predicate's result or ``policy.split``; see [Note:
    # declared splits] in dmuon_ownership), or None.
    split: MatrixSplit | None = None


class StepContext(NamedTuple):
    """What a holder's step view may depend on, fixed once ``Muon(model)`` is built."""

    ns: NSFunction  # the optimizer's Newton–Schulz
    lr_scaling: LrScaling
    tp_ns: TPMode
    layout: MeshLayout
    plan: Plan
    comm: DedicatedCommContext


class WeightPart(NamedTuple):
    """The part of one parameter that this rank steps (see [Note: the post-update hook] in
    ``optim/_step_plan``).

    Args:
        tensor: the values this rank updates: the owner's full master of a dedicated weight or
            its tensor-parallel shard, this rank's shard of an FSDP2 parameter, or a
            replicated parameter whole. A post-update hook may change it in place (never its
            shape or dtype); every rank's next forward reads the result.
        offsets: the index of ``tensor``'s first element in the full parameter, one int per
            dimension (all zeros for a whole weight).
        shape: the full parameter's shape.
    """

    tensor: Tensor  # the values this rank updates, changed in place by a hook
    offsets: tuple[int, ...]  # index of tensor's first element in the full parameter, per dim
    shape: tuple[int, ...]  # the full parameter's shape


class MuonEntry(NamedTuple):
    """A holder's step view: what one Muon parameter this rank steps looks like to the step
    (see [Note: the step plan] in ``optim/_step_plan``), or one piece of it where a split is
    declared (``rows``)."""

    group: dict[str, Any]  # its param group (hyperparameters read at every step)
    param: Tensor  # the key of its optimizer state
    holder: ParamHolder
    view: MatrixView  # its matrices, in the full parameter (or in its piece's rows)
    scale: float  # the learning-rate scale of each matrix
    matrices: int  # how many matrices this rank steps (0: an empty shard)
    matrix_shape: tuple[int, int]  # of each matrix this rank stacks for Newton–Schulz
    ns: NSFunction | None  # how its stack is orthogonalised (None: only its momentum advances)
    state_dtype: torch.dtype  # of its momentum
    # Entries share a Newton–Schulz stack only with equal tags (and shapes, dtypes, devices,
    # functions); see [Note: stepping expert sources] in ``_experts``.
    batch_tag: Hashable = False
    cut: MatrixView | None = None  # how the step cuts its tensors (None: as 2-D matrices)
    # The rows of the parameter this entry steps: a piece of a declared split (None: all).
    rows: tuple[int, int] | None = None

    @property
    def fqn(self) -> str:
        return self.holder.fqn


class ParamHolder:
    """One parameter dmuon takes over, on this rank (see [Note: parameter holders]): what every
    kind answers. A kind says which selected parameters it takes (``claims``) and what the step
    does with them; ``dedicated`` kinds (:class:`~._dedicated.DedicatedParam` and its
    subclasses) get an owner from the plan, live in packs and have the states of [Note: a
    holder's states]; the others stay where FSDP2 puts them, which holds them (:mod:`._experts`)."""

    dedicated: ClassVar[bool] = False

    fqn: str
    route: Route
    shape: torch.Size

    @classmethod
    def claims(cls, found: Found) -> bool:
        """Whether this kind takes ``found`` (the registry asks the kinds in order)."""
        raise NotImplementedError

    @classmethod
    def view_of(cls, found: Found) -> MatrixView | None:
        """The matrices Muon steps of ``found`` (``None``: it is not on the Muon route);
        raises, naming the parameter and the fix, where this kind cannot step them."""
        raise NotImplementedError

    # -- the step view -------------------------------------------------------------------------

    def muon_entries(self, group: dict[str, Any], context: StepContext) -> tuple[MuonEntry, ...]:
        """What the Muon step does with this parameter on this rank: one entry, one per piece
        of a declared split, or none (nothing here)."""
        raise NotImplementedError

    @property
    def steps_here(self) -> bool:
        """Whether this rank's optimizer steps the parameter (and keeps its state)."""
        raise NotImplementedError

    def step_tensors(self) -> tuple[Tensor | None, Tensor | None]:
        """The tensor the optimizer updates here and this step's gradient (``None``: this
        rank does not step it, or it got no gradient this step)."""
        raise NotImplementedError

    @property
    def optim_dtype(self) -> torch.dtype | None:
        """The dtype of its optimizer states (``None``: that of the tensor it steps)."""
        return None

    def weight_part(self, layout: MeshLayout) -> WeightPart:
        """What this rank steps of the parameter, for the post-update hooks."""
        raise NotImplementedError

    def clip_grad(self, layout: MeshLayout) -> tuple[tuple[Tensor, ...], bool] | None:
        """The gradients this rank hands to the clip (the parameter's, or views of the matrices
        Muon steps, which the clip scales in place) and whether another rank counts them
        (copies: scaled, not counted); ``None``: none here."""
        raise NotImplementedError

    @property
    def split_over_ranks(self) -> bool:
        """Whether ranks hold different parts of one of the matrices it hands to the clip, so
        that matrix's own norm needs a collective (an expert stack's shard holds whole
        experts)."""
        return False

    def fused_dtypes(self) -> tuple[torch.dtype, torch.dtype] | None:
        """The dtypes of the weight and gradient its fused passes will see (``None``: not
        known yet)."""
        raise NotImplementedError

    @property
    def publish_phase(self) -> str | None:
        """The step-profile phase of :meth:`publish` (``None``: this holder publishes
        nothing in the step)."""
        return None

    def publish(self, comm: DedicatedCommContext) -> Any:
        """Send this rank's update to the ranks that keep a copy, after the post-update hooks
        (kinds with a ``publish_phase``); returns the work to wait on."""
        raise NotImplementedError
