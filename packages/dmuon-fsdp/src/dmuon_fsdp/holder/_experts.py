"""The kinds FSDP2 holds: Muon expert stacks, stepped per expert where they lie, and those an
expert source steps for its replicas.

[Note: expert stacks]
A 3-D expert stack ``(E, out, in)`` selected for the Muon route is not dedicated: FSDP2
shards it on dim 0 (its default placement), so after its reduce-scatter every rank holds
the complete, averaged gradients of whole experts, and steps them where they are: momentum
on its shard, its experts' matrices in the NS batches of their shape, the update on its
shard, and FSDP2's next all-gather publishes them. No dmuon broadcast or reduce moves a
byte of them. ``torch.chunk`` decides which experts a rank holds (``E % N != 0`` and
``E < N`` leave some ranks with fewer or none: an empty shard steps nothing). Expert
parallelism (a DTensor sharded on dim 0 by an EP mesh, then by FSDP2) is the same. Every
mesh dim that does not shard dim 0 must replicate it (HSDP replicas each step their
identical shard, which stays identical); a stack split on another dim (FSDP2 ``Shard(1)``,
experts split by tensor parallelism) cannot be stepped per expert and is refused with the
fix. FSDP2 replaces the parameter object, so the stack is found through its module.

[Note: stepping expert sources]
Under HSDP the plan may name an expert stack shard's *source* replica (see [Note: expert
sources] in dmuon_ownership): that replica steps it for all, every other replica of the shard
only advances its momentum (the same elementwise arithmetic, so the state stays identical) and
receives the updated shard in the source's broadcast after the post-update hooks (the
:class:`SourcedExpertStack`'s ``publish``, the step's ``expert_publish`` phase). Replicas stay
bit-identical only if each replica that steps a matrix computes it exactly as the others do,
and an NS kernel may pick its algorithm by batch size: so under HSDP the stacks every replica
steps for itself form NS batches of their own (their step views' ``batch_tag``, identical on
every replica of a shard), apart from the owned and sourced matrices, whose results reach the
other replicas by broadcast. A sourced stack must lie where the plan assumed (FSDP2 on dmuon's
replicate x shard mesh, ``Shard(0)`` over the shard axis); anything else is refused with the
fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

import dmuon_ownership
from dmuon_ownership import Plan, ResolvedPolicy, Route

from .._matrix import Glu, MatrixView, NSFunction, is_conv_kernel
from .._torch_internals import local_shard
from ..topology import Axis, CommKind, DedicatedCommContext, MeshLayout
from ._holder import Found, MuonEntry, ParamHolder, StepContext, WeightPart
from ._tensors import tensor_view

__all__ = ["ExpertStack", "SourcedExpertStack", "check_expert_split"]


@dataclass(eq=False)
class ExpertStack(ParamHolder):
    """A Muon expert stack that stays where FSDP2 (and expert parallelism) puts it (see
    [Note: expert stacks]); ``view`` cuts it into its experts' matrices."""

    fqn: str
    module: nn.Module
    name: str  # attribute name on ``module``
    view: MatrixView
    policy: ResolvedPolicy = field(default_factory=ResolvedPolicy)
    route: Route = Route.MUON
    shape: torch.Size = field(init=False)

    def __post_init__(self) -> None:
        self.shape = self.param.shape

    @property
    def param(self) -> nn.Parameter:
        """The parameter the module holds now (FSDP2's DTensor after ``fully_shard``)."""
        param = self.module._parameters[self.name]
        assert param is not None, f"{self.fqn} was removed from its module"
        return param

    # -- at dedicate_params --------------------------------------------------------------------

    @classmethod
    def claims(cls, found: Found) -> bool:
        """A Muon-route stack of matrices, experts on dim 0."""
        if found.policy.route is not Route.MUON or is_conv_kernel(found.module, found.name):
            return False  # a Conv1d's 3-D kernel is one matrix (see [Note: what Muon steps])
        return MatrixView.of(found.param.shape, found.fqn).experts is not None

    @classmethod
    def view_of(cls, found: Found) -> MatrixView:
        """Its experts' matrices (see [Note: fused gate and up]); raises for a stack split
        where its experts cannot be stepped whole, and for a declared split (which cuts the
        rows of a 2-D weight; a fused gate and up stack says so with ``glu``)."""
        if isinstance(found.module, (nn.ConvTranspose1d, nn.Bilinear)):
            what = "weight" if isinstance(found.module, nn.Bilinear) else "kernel"
            raise ValueError(
                f"{found.fqn!r} (shape {tuple(found.param.shape)}) is the {what} of a"
                f" {type(found.module).__name__}, not a stack of experts: Muon would"
                " orthogonalise each of its slices on dim 0 apart. Leave it out of the"
                " predicate (keep p.ndim == 2, or name the expert stacks), or route it to"
                " 'adamw' with param_policy"
            )
        if found.split is not None:
            raise ValueError(
                f"{found.fqn!r} (shape {tuple(found.param.shape)}) has a declared split "
                f"{found.split}, but it is an expert stack, and a split cuts the rows of a 2-D "
                "weight; for a fused gate and up stack set param_policy's glu='split' instead"
            )
        layout = _expert_layout(found.name, found.module, found.policy, tuple(found.param.shape))
        view = MatrixView.of(found.param.shape, found.fqn, **layout)
        check_expert_split(found.fqn, found.param)
        return view

    @classmethod
    def planned(cls, found: Found, view: MatrixView) -> dmuon_ownership.ExpertStack | None:
        """What the planner weighs of the stack once FSDP2's dim-0 split leaves it on the grid
        (``None``: expert parallelism split it already, over a mesh of its own)."""
        if tensor_view(found.param).mesh_dims():
            return None  # laid out over a mesh before FSDP2: expert parallelism
        experts = view.experts
        assert experts is not None, f"{found.fqn} is not an expert stack"
        return dmuon_ownership.ExpertStack(experts, view.rows, view.cols, view.batch // experts)

    @classmethod
    def build(cls, found: Found, view: MatrixView, plan: Plan, layout: MeshLayout) -> ExpertStack:
        """The holder of ``found`` once the plan is made: one that an expert source steps
        where the plan names sources for the stack (see [Note: stepping expert sources])."""
        if not any(s.stack == found.fqn for s in plan.expert_sources):
            return cls(found.fqn, found.module, found.name, view, found.policy)
        replica = plan.expert_source(found.fqn, layout.coord.shard)
        source = None if replica is None else layout.rank_of[replica][layout.coord.shard]
        return SourcedExpertStack(
            found.fqn, found.module, found.name, view, found.policy, source=source
        )

    # -- the step view -------------------------------------------------------------------------

    def newton_schulz(self, context: StepContext) -> NSFunction | None:
        return context.ns

    @property
    def replica_stepped(self) -> bool:
        """Whether every replica steps this rank's shard itself (so its NS batch must be the
        same on every replica; see [Note: stepping expert sources])."""
        return True

    def muon_entries(self, group: dict[str, Any], context: StepContext) -> tuple[MuonEntry, ...]:
        """This rank's shard of the stack, as FSDP2 left it."""
        return (self._entry(group, context),)

    def _entry(self, group: dict[str, Any], context: StepContext) -> MuonEntry:
        p = self.param
        check_expert_split(self.fqn, p)
        view = self.view
        return MuonEntry(
            group,
            p,
            self,
            view,
            view.lr_scale(context.lr_scaling),
            view.count(local_shard(p).shape),
            view.matrix_shape,
            self.newton_schulz(context),
            p.dtype,
            batch_tag=context.layout.is_hsdp and self.replica_stepped,
            cut=view,
        )

    @property
    def steps_here(self) -> bool:
        return True  # its shard, or its momentum where another replica steps it

    def step_tensors(self) -> tuple[Tensor | None, Tensor | None]:
        p = self.param
        return p, p.grad

    def weight_part(self, layout: MeshLayout) -> WeightPart:
        return tensor_view(self.param).weight_part(layout)

    def clip_grad(self, layout: MeshLayout) -> tuple[tuple[Tensor, ...], bool] | None:
        """This rank's shard of the gradient; it counts once, on the first replica of every
        mesh dim that replicates it (the others pass it as a copy)."""
        return tensor_view(self.param).clip_grad(layout)

    def fused_dtypes(self) -> tuple[torch.dtype, torch.dtype] | None:
        dtype = self.param.dtype
        return dtype, dtype

    def publish(self, comm: DedicatedCommContext) -> Any:
        raise AssertionError("FSDP2's all-gather publishes an expert stack")


@dataclass(eq=False)
class SourcedExpertStack(ExpertStack):
    """An expert stack for whose shards the plan names source replicas (under HSDP): the
    source steps this rank's shard for its whole column and broadcasts it after the
    post-update hooks; the others only advance its momentum (see [Note: stepping expert
    sources])."""

    # The global rank of the replica that steps this rank's shard (None: the plan names no
    # source for it, and every replica steps it).
    source: int | None = None

    @property
    def publish_phase(self) -> str | None:
        return None if self.source is None else "expert_publish"

    @property
    def replica_stepped(self) -> bool:
        return self.source is None

    def newton_schulz(self, context: StepContext) -> NSFunction | None:
        layout = context.layout
        if self.source not in (None, layout.global_rank(layout.coord)):
            return None  # another replica steps it: only the momentum advances here
        return context.ns

    def muon_entries(self, group: dict[str, Any], context: StepContext) -> tuple[MuonEntry, ...]:
        entry = self._entry(group, context)
        _check_source_layout(self.fqn, entry.param, context.layout)
        return (entry,)

    def publish(self, comm: DedicatedCommContext) -> Any:
        """Broadcast the stepped shard from its source over the shard's replicas."""
        shard = local_shard(self.param)
        assert self.source is not None and shard.is_contiguous(), self.fqn
        work = dist.broadcast(shard, src=self.source, group=comm.replicate_group, async_op=True)
        comm.counter.record(Axis.REPLICATE, CommKind.PUBLISH, shard.numel() * shard.itemsize)
        return work


def _check_source_layout(fqn: str, p: Tensor, layout: MeshLayout) -> None:
    """A stack with expert sources must be sharded by FSDP2 on dmuon's own replicate x shard
    mesh, as the plan assumed (see [Note: stepping expert sources])."""
    grid = [list(row) for row in layout.rank_of]
    if isinstance(p, DTensor):
        mesh = p.device_mesh.mesh.tolist()
        if p.device_mesh.ndim == 2 and mesh == grid and p.placements == (Replicate(), Shard(0)):
            return
        where = f"mesh {mesh} with placements {p.placements}"
    else:
        where = "a plain tensor"
    raise ValueError(
        f"expert stack {fqn!r} is {where}, but dmuon planned its experts over the HSDP "
        f"grid {grid} (replicate x shard), where one replica steps some expert shards for "
        "all; fully_shard the experts' module with the mesh whose 'shard' and 'replicate' "
        "dimensions dedicate_params was given (FSDP2's default Shard(0))"
    )


def _cuts_experts(placement: Placement, ndim: int) -> bool:
    """Whether ``placement`` shards a dim other than the experts' (dim 0)."""
    return placement.is_shard() and not (placement.is_shard(0) or placement.is_shard(-ndim))


def check_expert_split(fqn: str, param: Tensor) -> None:
    """Raise unless ``param``, an expert stack, can be stepped per expert where it lies: every
    mesh dim must shard its dim 0 or replicate it (see [Note: expert stacks])."""
    bad = [
        (name, placement)
        for name, placement in tensor_view(param).mesh_dims()
        if _cuts_experts(placement, param.ndim)
    ]
    if not bad:
        return
    where = ", ".join(f"{p} on mesh dim {name!r}" for name, p in bad)
    raise ValueError(
        f"expert stack {fqn!r} (shape {tuple(param.shape)}) is split by {where}, which cuts "
        "every expert; Muon steps whole experts where they lie: shard it on dim 0 (FSDP2's "
        "default; with torchtitan-style meshes pass fully_shard(..., shard_placement_fn="
        "lambda p: Shard(0)) for the experts), or leave it out of the predicate"
    )


def _expert_layout(
    name: str, module: nn.Module, policy: ResolvedPolicy, shape: tuple[int, ...]
) -> dict[str, Any]:
    """The GLU layout and orientation of an expert stack (see [Note: fused gate and up]).

    [Note: fused gate and up]
    An expert stack holds gate and up together (orthogonalised apart, as two matrices per
    expert) only where that is declared or recognised, never because of its name alone (a
    user's own ``gate_up_proj`` may be one matrix): ``param_policy``'s ``glu`` declares it
    (``'split'``, or ``'joint'`` for one matrix); otherwise a module that carries Hugging Face's
    experts flags (``has_gate``, ``is_concatenated``, ``is_transposed``: transformers 5 sets
    them on every experts module) says so; otherwise a ``gate_up`` stack is fused when its
    shape is the gate and up of its module's ``down`` stack, ``(E, 2I, H)`` beside ``(E, H,
    I)`` (transposed: ``(E, H, 2I)`` beside ``(E, I, H)``). Gate and up lie concatenated on
    the rows unless the module says interleaved. ``summarize_param_groups`` shows the split
    of each Muon parameter (its ``matrices`` entry) and ``dedicate_params`` logs the stacks
    it split. Anything else (torchtitan's separate ``w1``/``w3``/``w2``) is one matrix per
    expert."""
    transposed = bool(getattr(module, "is_transposed", False))
    if policy.glu is not None:
        fused = policy.glu == "split"
    elif "gate_up" not in name:
        fused = False
    elif hasattr(module, "has_gate"):
        fused = bool(module.has_gate)
    else:
        down = getattr(module, name.replace("gate_up", "down"), None)
        fused = isinstance(down, torch.Tensor) and _gate_and_up_of(shape, down.shape, transposed)
    glu = Glu.NONE
    if fused:
        glu = Glu.CONCAT if bool(getattr(module, "is_concatenated", True)) else Glu.INTERLEAVED
    return {"glu": glu, "transposed": transposed}


def _gate_and_up_of(shape: tuple[int, ...], down: torch.Size, transposed: bool) -> bool:
    """Whether a stack of ``shape`` holds the gate and up projections whose down projection
    has shape ``down`` (see [Note: fused gate and up])."""
    if len(shape) != 3 or len(down) != 3 or shape[0] != down[0]:
        return False
    if transposed:  # gate_up (E, H, 2I), down (E, I, H)
        return shape[1] == down[2] and shape[2] == 2 * down[1]
    return shape[1] == 2 * down[2] and shape[2] == down[1]  # (E, 2I, H) and (E, H, I)
