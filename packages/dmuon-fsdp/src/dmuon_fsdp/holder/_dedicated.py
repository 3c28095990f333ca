"""The dedicated kinds: a matrix packed with its owner's others, and a tensor-parallel shard.

[Note: storage of a dedicated parameter]

The module keeps its registered ``nn.Parameter`` object for the whole run (so
``named_parameters()``, ``state_dict()`` keys and parameter identity in the optimizer never
change). Only ``param.data`` is swapped, once, at setup: it becomes a view into the packed
buffer of its (boundary, owner) unit (:meth:`DedicatedParam.place`, see [Note: packs] in
``runtime/_pack``). On the sender of the unit (the owner, and in HSDP every rank of the
owner's shard column) that buffer always holds the weight; everywhere else its storage is
resized to zero between uses, so the parameter keeps its full shape but holds no memory.
Resizing the *storage* (not reassigning ``.data``) is what lets autograd's saved tensors, which
alias that storage, see the weight again when it is re-broadcast before backward. ``param.data
= view`` keeps the parameter's own version counter, so writes into the buffer never bump the
counter autograd checks on the parameter.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from dmuon_ownership import MatrixSplit, Owner, ResolvedPolicy, Route

from .._matrix import MatrixView, NSFunction, Piece, is_conv_kernel, matrix_shape, pieces_of
from .._torch_internals import disable_torch_function_subclass, local_shard
from ..topology import DedicatedCommContext, MeshLayout
from ._guard import (
    GuardedDTensor,
    GuardedParameter,
    attach_holder,
    guard_parameter,
)
from ._holder import Found, HolderState, MuonEntry, ParamHolder, Role, StepContext, WeightPart
from ._pending import PendingDTensor, PendingParameter
from ._precision import Precision
from ._tp_ns import TensorParallelNS, TPMode, choose

__all__ = ["DedicatedParam", "TensorParallelParam"]

Waiter = weakref.WeakMethod[Callable[[], None]]


@dataclass(eq=False)
class DedicatedParam(ParamHolder):
    """A parameter whose optimizer step runs only on its global owner: a plain matrix (or, on
    the AdamW route, any plain parameter) packed with the others its owner sends for its hook
    boundary.

    ``full`` is the owner's authoritative full weight, in the master dtype (the tensor the
    optimizer updates in place; ``None`` on other ranks); ``grad`` is the owner's averaged full
    gradient after a synced backward, in the reduce dtype (``None`` elsewhere and after
    ``zero_grad``). ``precision`` says which dtype is used where (see [Note: mixed precision]);
    it and ``full`` are set when the runtime packs its parameters (:meth:`place`).
    """

    dedicated: ClassVar[bool] = True
    # The parameter's class in each state; see [Note: a holder's states].
    classes: ClassVar[Mapping[HolderState, type[Tensor]]] = {
        HolderState.UNPLACED: GuardedParameter,
        HolderState.RELEASED: GuardedParameter,
        HolderState.HELD: nn.Parameter,
        HolderState.RECEIVING: PendingParameter,
    }
    # Whether it travels in a pack of its own (see [Note: packs] in runtime/_pack).
    packs_alone: ClassVar[bool] = False
    # Whether ``to_empty`` swaps its contents into the same object (else it makes a new one).
    swapped_by_to_empty: ClassVar[bool] = False

    fqn: str
    param: nn.Parameter
    module: nn.Module
    name: str  # attribute name on ``module``
    boundary: str  # FQN of the hook boundary module ("" for the root)
    owner: Owner
    role: Role
    route: Route
    policy: ResolvedPolicy = field(default_factory=ResolvedPolicy)
    precision: Precision | None = None
    offset: int = 0  # element offset inside its pack's buffer
    full: Tensor | None = None
    grad: Tensor | None = None
    # Whether a backward since the last reduce was issued gave this rank a local gradient (see [Note: a
    # parameter without a gradient] in runtime/_collectives).
    saw_grad: bool = False
    # Tensor parallelism: the dim the TP shards split (None: not tensor-parallel); the runtime
    # then moves and steps this rank's shard (see [Note: tensor-parallel grids] in topology/_mesh).
    tp_dim: int | None = None
    # Names the parameter, its owner and this rank's role in errors (see _guard).
    where: str = ""
    # A pipeline stage's: its local gradient leaves from ``.grad`` at the step, whatever wrote
    # it (see [Note: weight gradients a schedule writes] in runtime/_hooks).
    reduced_at_step: bool = False
    # A declared split (see [Note: declared splits] in dmuon_ownership): its owner steps each
    # piece as a matrix of its own (None: the weight is one matrix).
    split: MatrixSplit | None = None
    shape: torch.Size = field(init=False)  # the full (global) shape
    pieces: tuple[Piece, ...] = field(init=False)  # the declared split's pieces (or none)
    local_shape: torch.Size = field(init=False)  # this rank's shard's (the full one without TP)
    dtype: torch.dtype = field(init=False)  # the master dtype
    # Stored (in, out), as Hugging Face's Conv1D (GPT-2) stores its weight: the learning-rate
    # scale reads it the other way round (MatrixView.transposed); NS does not care.
    stored_in_out: bool = field(init=False)
    # The kernel of an nn.Conv1d/2d/3d: Muon steps it as one (out, in/groups·∏k) matrix (see
    # [Note: what Muon steps]).
    conv_kernel: bool = field(init=False)
    _current: HolderState = field(default=HolderState.HELD, init=False, repr=False)
    _wait: Waiter | None = field(default=None, init=False, repr=False)
    # The parameter's version when its resident compute copy last matched the owner's master
    # (see [Note: writes into a resident compute copy]).
    _copy_version: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.shape = self.param.shape
        self.local_shape = self.tensor.shape
        self.dtype = self.param.dtype
        self.pieces = () if self.split is None else pieces_of(self.shape, self.fqn, self.split)
        self.stored_in_out = _stores_in_out(self.module, self.name, self.shape)
        self.conv_kernel = is_conv_kernel(self.module, self.name)
        self.attach(self.param)

    @classmethod
    def claims(cls, found: Found) -> bool:
        """Every parameter the kinds before it leave."""
        return True

    @classmethod
    def view_of(cls, found: Found) -> MatrixView | None:
        """The matrix a Muon-route parameter is (raising, with the fix, for a shape Muon cannot
        step, or a declared split that does not fit it); ``None`` on the AdamW route."""
        if found.policy.route is not Route.MUON:
            if found.split is not None:
                raise ValueError(
                    f"{found.fqn!r} has a declared split {found.split}, but its route is "
                    f"{found.policy.route.value!r}: a split cuts the matrices Muon "
                    "orthogonalises; declare it only for Muon-route weights"
                )
            return None
        kernel = is_conv_kernel(found.module, found.name)
        view = MatrixView.of(found.param.shape, found.fqn, kernel=kernel)
        if found.split is not None:
            if _stores_in_out(found.module, found.name, found.param.shape):
                raise ValueError(
                    f"{found.fqn!r} has a declared split {found.split}, but it is a Conv1D"
                    " weight stored (in, out): a split cuts the stored rows, its input"
                    " features, not its fused outputs (q, k, v of GPT-2's c_attn). Drop the"
                    " split (the weight is then one matrix), or replace the Conv1D by an"
                    " nn.Linear holding its transpose and split that"
                )
            pieces_of(found.param.shape, found.fqn, found.split)
        return view

    @property
    def view(self) -> MatrixView:
        """The matrix Muon steps of the whole weight (see [Note: what Muon steps]); a
        declared split's pieces have views of their own (``pieces``)."""
        return MatrixView.of(
            self.shape, self.fqn, transposed=self.stored_in_out, kernel=self.conv_kernel
        )

    @property
    def tensor(self) -> Tensor:
        """What dmuon packs and steps: the parameter, or its local shard when it is a DTensor."""
        return local_shard(self.param)

    @property
    def is_owner(self) -> bool:
        return self.role is Role.OWNER

    @property
    def numel(self) -> int:
        """Elements this rank packs (its TP shard's)."""
        return math.prod(self.local_shape)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.fqn!r}, shape={tuple(self.shape)}, "
            f"owner={tuple(self.owner)}, role={self.role.value}, route={self.route.value!r})"
        )

    # -- state: see [Note: a holder's states] --------------------------------------------------

    @property
    def unplaced(self) -> bool:
        return self._current is HolderState.UNPLACED

    def _enter(self, state: HolderState) -> None:
        self._current = state
        self.param.__class__ = self.classes[state]  # type: ignore[assignment]  # keeps _is_param

    def to_held(self) -> None:
        assert self._current in (
            HolderState.UNPLACED,
            HolderState.RELEASED,
            HolderState.RECEIVING,
        ), f"{self.fqn}: to_held from {self._current.name}"
        self._wait = None
        self._enter(HolderState.HELD)

    def to_released(self) -> None:
        assert self._current in (HolderState.UNPLACED, HolderState.HELD), (
            f"{self.fqn}: to_released from {self._current.name}"
        )
        self._enter(HolderState.RELEASED)

    def to_unplaced(self) -> None:
        assert self._current is HolderState.HELD, (
            f"{self.fqn}: to_unplaced from {self._current.name}"
        )
        self._enter(HolderState.UNPLACED)

    def to_receiving(self, wait: Waiter) -> None:
        assert self._current is HolderState.HELD, (
            f"{self.fqn}: to_receiving from {self._current.name}"
        )
        self._wait = wait
        self._enter(HolderState.RECEIVING)

    def attach(self, param: nn.Parameter) -> None:
        """Take ``param`` over (at ``dedicate_params``, or the new object ``to_empty`` made of
        a meta parameter): mark it dedicated and give it the class of the current state; a new
        object holds what it was given."""
        guard_parameter(param, self.where)
        attach_holder(param, self, replaced=self.param)
        self.param = param
        if self._current is HolderState.HELD:
            self._enter(HolderState.HELD)
        else:
            self.to_held()

    # -- verbs: safe in any state --------------------------------------------------------------

    def place(self, view: Tensor, offset: int, *, keeps: bool, resident: bool) -> Tensor | None:
        """Move into ``view``, this parameter's slot of its pack buffer at ``offset``
        (``keeps``: this rank keeps the weight, which is copied in; ``resident``: every rank
        keeps it, the replicated path). With a compute dtype below the master the owner keeps
        the master apart and returns it (see [Note: mixed precision])."""
        precision = self.precision
        assert precision is not None, f"{self.fqn}: resolve the precision before packing"
        weight = None
        if keeps:
            # Its current weight: as built, or its previous pack's (a repack).
            weight = self.tensor.detach() if self.full is None else self.full
            with torch.no_grad():
                view.copy_(weight)
        self.offset = offset
        self.dtype = precision.master
        self.hold()  # a repack re-points a freed peer parameter
        if self.role is Role.OWNER and precision.mixed:
            assert weight is not None
            # A tensor of its own, not the parameter's detached storage, whose version counter
            # the parameter would share: the step's writes into the master would then look
            # like writes into the copy (see [Note: writes into a resident compute copy]).
            master = weight.to(precision.master, copy=weight is not self.full)
            self.full = master
            self.tensor.data = view if resident else master
            self.copy_matches_master()
            return master
        self.tensor.data = view
        if self.role is Role.OWNER:
            self.full = view
        return None

    def copy_matches_master(self) -> None:
        """The parameter's values are its master's now (cast): only a later in-place write
        to the parameter makes them differ (see [Note: writes into a resident compute copy])."""
        self._copy_version = self.tensor._version

    def adopt_written_copy(self) -> None:
        """The owner of a resident compute copy (the replicated path, a compute dtype below
        the master): if the parameter was written in place since its values last matched the
        master, the master takes them, so that the step updates the weight every rank computed
        with (see [Note: writes into a resident compute copy])."""
        master = self.full
        if master is None or self._copy_version == self.tensor._version:
            return
        with torch.no_grad():
            master.copy_(self.tensor)
        self.copy_matches_master()

    def hold(self) -> None:
        """This rank holds the weight again (a peer's pack got its storage back)."""
        if self._current is not HolderState.HELD:
            self.to_held()

    def release(self) -> None:
        """This rank no longer holds the weight (a peer's pack dropped its storage)."""
        if self._current is not HolderState.RELEASED:
            self.to_released()

    def drop_storage(self) -> None:
        """Free what ``to_empty`` allocated for the weight on a rank that keeps none before
        packing (a tensor-parallel shard; a plain weight materialised without storage has
        none): reads raise until packing gives it a place (see [Note: meta-device models] in
        ``runtime/_runtime``)."""
        tensor = self.tensor
        if tensor.is_meta:
            return
        storage = tensor.untyped_storage()
        if storage.size() != 0:
            storage.resize_(0)
        self.to_unplaced()

    def receive(self, wait: Waiter) -> None:
        """A publish is sending (the owner) or overwriting this rank's copy; ``wait`` (its
        group's ``wait_for_publish``) lands it. A weight not held here has nothing to send or
        overwrite."""
        if self._current is HolderState.HELD:
            self.to_receiving(wait)

    def landed(self) -> None:
        """The publish into this rank's copy was waited on."""
        if self._current is HolderState.RECEIVING:
            self.to_held()

    def land(self) -> None:
        """Wait for the publish into this rank's copy (a read needs its values)."""
        wait = None if self._wait is None else self._wait()
        if wait is not None:
            wait()  # the group's wait_for_publish: lands every copy it published
        self.landed()

    def not_held_message(self, operation: str, cause: str = "") -> str:
        """The error a read of the weight raises while this rank does not hold it; ``cause``
        says what in the caller made the read, where that is known."""
        return (
            f"{self.where} is not held on this rank right now (operation: {operation}). "
            f"{cause + ' ' if cause else ''}dmuon "
            "keeps a dedicated weight whole only on its owner; other ranks receive it for their "
            "layer's forward and backward and free it afterwards. Read it with "
            "dmuon.get_model_state_dict(model) (collective: call it on every rank), on its owner "
            "through dmuon.runtime.get_owned_params(model, rank)[i].full, or inside the forward "
            "of its layer; write whole weights with dmuon.set_model_state_dict(model, "
            "state_dict) (collective), initialise those of a meta-device model after to_empty "
            "with dmuon.init_dedicated_(model, fn) (on the ranks that keep them); for sharded "
            "checkpoints (model.state_dict() with DCP) use dmuon.save_checkpoint / "
            "dmuon.load_checkpoint or dmuon.AppState(model, optimizer), and for the functions of "
            "torch.distributed.checkpoint.state_dict (get_state_dict, "
            "get_optimizer_state_dict, ...) dmuon's functions of the same names"
        )

    # -- the reduce target: see [Note: gradient reduction] in runtime/_collectives -------------

    def take_local_grad(self) -> Tensor | None:
        """This rank's local gradient (its TP shard's) on its way to the owner; the
        parameter's ``.grad`` is dropped (FSDP2, AdamW and torch's clipping never see it)."""
        grad = self.param.grad
        if grad is None:
            # Nothing to drop. Its layer's backward may not have run at all (a loss taken
            # before it), so a peer may hold no weight now, and setting .grad raises there.
            return None
        self.param.grad = None
        self.saw_grad = True
        return local_shard(grad)

    def widen_local_grad(self) -> None:
        """A backward under ``no_sync`` left this rank's local gradient in ``.grad``: from now
        on it accumulates in the reduce dtype where that is wider than the gradient's (see
        [Note: accumulating in the reduce dtype] in :mod:`._precision`); nothing otherwise."""
        grad = self.param.grad
        precision = self.precision
        if grad is None or precision is None or precision.reduce.itemsize <= grad.dtype.itemsize:
            return
        # .grad is metadata of the holder, set in any state (a guarded class refuses a write).
        with disable_torch_function_subclass():
            self.param.grad_dtype = None
            self.param.grad = grad.to(precision.reduce)

    def accumulate_grad(self, grad: Tensor) -> None:
        """Add ``grad``, this backward's averaged gradient, to the owner's ``grad`` (a view of
        ``grad`` when it was unset)."""
        if self.grad is None:
            self.grad = grad
        else:
            self.grad.add_(grad)

    # -- the step view: see [Note: parameter holders] ------------------------------------------

    def newton_schulz(self, context: StepContext) -> NSFunction:
        """How this matrix is orthogonalised: in the NS stacks of its shape (the optimizer's
        function, ``context.ns``). A kind that orthogonalises otherwise overrides this with a
        function of a ``(batch, m, n)`` stack that returns that shape; matrices share a batch
        only where their kinds return the same function object."""
        return context.ns

    def tp_mode(self, tp_ns: TPMode, ns: NSFunction) -> TPMode | None:
        """How its Newton–Schulz runs over its TP group under ``StepOptions(tp_ns=tp_ns)`` and
        the optimizer's ``ns`` (see [Note: Newton–Schulz under tensor parallelism]); ``None``:
        it is not split over TP ranks."""
        return None

    def muon_entries(self, group: dict[str, Any], context: StepContext) -> tuple[MuonEntry, ...]:
        """Its owner's entry, or one per piece of a declared split: each piece's matrices go
        into the NS batch of their shape, scaled for their shape (see [Note: what Muon
        steps])."""
        if not self.is_owner:
            return ()
        assert self.precision is not None, f"{self.fqn}: the runtime has not packed its parameters"
        ns = self.newton_schulz(context)
        if not self.pieces:
            view = self.view
            scale = view.lr_scale(context.lr_scaling)
            # a TP shard's matrix is its local one; a whole weight's (a conv kernel's
            # flattened) is the view's
            shape = view.matrix_shape if self.tp_dim is None else matrix_shape(self.local_shape)
            # a conv kernel's tensors are cut as its view says; a 2-D weight is its own matrix
            cut = view if view.kernel else None
            return (
                MuonEntry(
                    group,
                    self.param,
                    self,
                    view,
                    scale,
                    1,
                    shape,
                    ns,
                    self.precision.optim,
                    cut=cut,
                ),
            )
        return tuple(
            MuonEntry(
                group,
                self.param,
                self,
                piece.view,
                piece.view.lr_scale(context.lr_scaling),
                piece.view.batch,
                piece.view.matrix_shape,
                ns,
                self.precision.optim,
                cut=piece.view,
                rows=(piece.start, piece.stop),
            )
            for piece in self.pieces
        )

    @property
    def steps_here(self) -> bool:
        return self.is_owner

    def step_tensors(self) -> tuple[Tensor | None, Tensor | None]:
        return self.full, self.grad

    @property
    def optim_dtype(self) -> torch.dtype | None:
        assert self.precision is not None, f"{self.fqn}: the runtime has not packed its parameters"
        return self.precision.optim

    def weight_part(self, layout: MeshLayout) -> WeightPart:
        """The owner's master: whole, or its TP shard at this rank's TP index."""
        assert self.full is not None, f"{self.fqn}: the owner holds no full weight"
        offsets = [0] * len(self.shape)
        if self.tp_dim is not None:
            offsets[self.tp_dim] = layout.tp_index * int(self.local_shape[self.tp_dim])
        return WeightPart(self.full, tuple(offsets), tuple(self.shape))

    def clip_grad(self, layout: MeshLayout) -> tuple[tuple[Tensor, ...], bool] | None:
        """The owner's averaged gradient as the matrices Muon steps, views that a clip scales
        in place; a whole matrix (not tensor-parallel) is kept in every TP grid and counted in
        grid 0 (see [Note: global quantities] in ``topology/_comm``). A convolution kernel's is
        the one flattened matrix, so that a per-matrix clip does not clip each ``(kh, kw)``
        slice apart; a declared split's is one view per piece (its rows, a ``(rows, cols)``
        matrix or a ``(count, rows, cols)`` stack of per-head matrices), so that a per-matrix
        clip clips q, k and v apart, as it clips separate modules (a split weight is never a
        TP shard: ``TensorParallelParam.view_of`` refuses that)."""
        grad = self.grad
        if grad is None:
            return None
        copy = layout.tp_index > 0 and self.tp_dim is None
        if self.pieces:
            return tuple(_piece_grad(grad, piece) for piece in self.pieces), copy
        if self.conv_kernel:
            grad = grad.view(self.view.matrix_shape)
        return (grad,), copy

    @property
    def split_over_ranks(self) -> bool:
        """A tensor-parallel matrix's TP shards."""
        return self.tp_dim is not None

    def fused_dtypes(self) -> tuple[torch.dtype, torch.dtype] | None:
        if self.full is None or self.precision is None:
            return None
        return self.full.dtype, self.precision.reduce

    def publish(self, comm: DedicatedCommContext) -> Any:
        raise AssertionError("a dedicated parameter is published by its group")

    # -- checkpoints ---------------------------------------------------------------------------

    def tp_part(self, full: Tensor, index: int) -> Tensor:
        """TP index ``index``'s part of a full tensor laid out as the parameter: the whole
        tensor (a kind that is not tensor-parallel)."""
        return full

    def local_part(self, full: Tensor) -> Tensor:
        """The part of a full tensor laid out as the parameter that this rank keeps."""
        return full

    def holding(self) -> tuple[Any, ...] | None:
        """Which state of it this rank's optimizer holds (``None``: none); see [Note: loading
        another rank's optimizer state dict] in ``optim/_state_checks``."""
        return ("owner", 0) if self.is_owner else None


@dataclass(eq=False, repr=False)
class TensorParallelParam(DedicatedParam):
    """A tensor-parallel matrix: a ``DTensor`` whose local shard dmuon packs and steps (the
    whole matrix on a one-rank TP mesh, ``tp_dim`` None). It travels in a pack of its own:
    dynamo cannot fake a ``DTensor`` whose local shard shares its storage or starts at an
    offset into it (torch 2.13: "Attempted to set the storage of a tensor on device cpu to a
    storage on different device meta"), so a compiled block holding packed TP shards would
    fail to trace; its bytes are the same, at one more broadcast per matrix. Its Newton–Schulz is
    :class:`~._tp_ns.TensorParallelNS` (see [Note: Newton–Schulz under tensor parallelism])."""

    classes: ClassVar[Mapping[HolderState, type[Tensor]]] = {
        HolderState.UNPLACED: GuardedDTensor,
        HolderState.RELEASED: GuardedDTensor,
        HolderState.HELD: DTensor,
        HolderState.RECEIVING: PendingDTensor,
    }
    packs_alone: ClassVar[bool] = True
    swapped_by_to_empty: ClassVar[bool] = True

    @classmethod
    def claims(cls, found: Found) -> bool:
        """Any ``DTensor`` parameter (tensor parallelism applied before ``dedicate_params``)."""
        return isinstance(found.param, DTensor)

    @classmethod
    def view_of(cls, found: Found) -> MatrixView | None:
        """As a plain matrix's; a declared split is refused where the matrix is sharded over
        more than one TP rank (its shards cut across the pieces)."""
        mesh = cast(DTensor, found.param).device_mesh
        muon = found.policy.route is Route.MUON
        if muon and is_conv_kernel(found.module, found.name) and mesh.size() > 1:
            raise ValueError(
                f"{found.fqn!r} (shape {tuple(found.param.shape)}) is the kernel of a"
                f" tensor-parallel {type(found.module).__name__} (sharded over {mesh.size()} TP"
                " ranks); Muon steps a convolution kernel as one flattened matrix, which dmuon"
                " does not split over TP ranks: leave the convolution out of the TP plan, or"
                " route its kernel to 'adamw' with param_policy"
            )
        if found.split is not None and mesh.size() > 1:
            raise ValueError(
                f"{found.fqn!r} has a declared split {found.split}, but it is a tensor-parallel "
                f"matrix (sharded over {mesh.size()} TP ranks), whose shards cut across the "
                "pieces; declare the split only on weights that are not tensor-parallel, or "
                "use separate q, k and v modules under tensor parallelism"
            )
        return super().view_of(found)

    def newton_schulz(self, context: StepContext) -> NSFunction:
        mode = self.tp_mode(context.tp_ns, context.ns)
        if mode is None:
            return context.ns
        comm = context.comm
        assert comm.tp_group is not None and self.tp_dim is not None
        owner = context.layout.tp_ranks(self.owner)[context.plan.tp_owner_of(self.fqn)]
        return TensorParallelNS(
            context.ns,
            shape=MatrixView.of(self.shape, self.fqn).matrix_shape,
            tp_dim=self.tp_dim,
            mode=mode,
            group=comm.tp_group,
            tp_owner=owner,
            counter=comm.counter,
        )

    def tp_mode(self, tp_ns: TPMode, ns: NSFunction) -> TPMode | None:
        if self.tp_dim is None:
            return None
        shape = MatrixView.of(self.shape, self.fqn).matrix_shape
        return choose(tp_ns, shape, self.tp_dim, ns, self.tp_size, self.ns_itemsize)

    @property
    def tp_size(self) -> int:
        """The number of TP ranks the parameter is split over."""
        return cast(DTensor, self.param).device_mesh.size()

    @property
    def ns_itemsize(self) -> int:
        """Bytes per element of its NS input (its momentum's dtype)."""
        assert self.precision is not None, f"{self.fqn}: the runtime has not packed its parameters"
        return self.precision.optim.itemsize

    @property
    def tp_index(self) -> int:
        """This rank's index on the parameter's TP mesh."""
        return cast(DTensor, self.param).device_mesh.get_local_rank()

    def tp_part(self, full: Tensor, index: int) -> Tensor:
        """TP index ``index``'s shard of a full tensor (equal shards, in order)."""
        if self.tp_dim is None:
            return full
        size = self.local_shape[self.tp_dim]
        return full.narrow(self.tp_dim, index * size, size)

    def local_part(self, full: Tensor) -> Tensor:
        return self.tp_part(full, self.tp_index)

    def holding(self) -> tuple[Any, ...] | None:
        if not self.is_owner:
            return None
        if self.tp_dim is None:
            return ("owner", 0)
        return ("owner", self.tp_index, "of", self.tp_size)


def _stores_in_out(module: nn.Module, name: str, shape: Sequence[int]) -> bool:
    """Whether ``module.<name>`` is a matrix stored ``(in, out)``: the weight of Hugging Face's
    ``Conv1D`` (``transformers.pytorch_utils``; GPT-2's ``c_attn``, ``c_fc``, ``c_proj``), whose
    ``nf`` output features are its columns."""
    kind = type(module)
    return (
        name == "weight"
        and kind.__name__ == "Conv1D"
        and kind.__module__.startswith("transformers.")
        and len(shape) == 2
        and getattr(module, "nf", None) == shape[1]
    )


def _piece_grad(grad: Tensor, piece: Piece) -> Tensor:
    """``piece``'s rows of a split weight's gradient as its matrices (one ``(rows, cols)``, or a
    ``(count, rows, cols)`` stack): a view, so that scaling it scales ``grad``."""
    rows = grad[piece.start : piece.stop]
    view = piece.view
    return rows if view.batch == 1 else rows.view(view.batch, view.rows, view.cols)
