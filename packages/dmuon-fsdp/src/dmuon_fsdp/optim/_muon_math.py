"""The owner step: momentum, Nesterov, Newton–Schulz batched by shape, lr scaling, weight decay,
and the AdamW step for everything else. Small pure functions over plain tensors; the optimizer
decides which tensors they see.

[Note: one Newton–Schulz call per shape]
After the reduce, an owner holds the full gradients of every matrix it owns. Matrices of one
shape are stacked into a single ``(batch, m, n)`` tensor and orthogonalised by one NS call, so
a rank that owns twelve ``(1024, 4096)`` projections issues one batched NS instead of twelve. NS acts on each matrix of the batch independently, so the
result equals twelve separate calls up to the rounding of batched matrix products. The NS
function is whatever the optimizer was given (a ``dmuon_ns.NewtonSchulz`` or any callable on a
``(batch, m, n)`` stack), called once per batch: by :func:`muon_batch`, or early, during
backward, by ``ns_overlap`` (``_ns_overlap``).

The NS inputs are written straight into the stack (no per-matrix temporary), and the stack
lives only while its NS runs. Its transient memory peaks at 3.25 to 4 times the stack itself
(``benchmarks/ns_memory.py``, by live storages: for a wide or tall matrix the stack, NS's
scaled copy and the iterate after the restart, or the result, and one m×m matrix, 3.25 times
at the 1:4 of a Llama MLP and 3.5 times at the 3:8 of MoE experts; for a square one, which
runs direct NS, the stack, the iterate, ``Z'`` and the next iterate, 4 times; CUDA-graph
replay adds a static input and output), which for the large matrices of a big model would be
several GiB if every same-shape matrix went into one stack: with a 512 MiB cap an 8-layer
H=4096 Llama stack stepped with ~3.9 GiB more than torch.optim.Muon's per-matrix loop. So
``max_batch_bytes`` caps one stack's input size: a shape whose matrices exceed it runs in a
few calls, and a matrix larger than the cap runs alone. Batching pays off for small matrices
(launch-bound), which always fit; a ``(14336, 4096)`` matrix already fills the GPU on its own.
``None`` lifts the cap (exactly one call per shape).

[Note: Newton–Schulz that waits for peers]
A tensor-parallel matrix orthogonalised by gathering (``StepOptions(tp_ns="gather")``, see
[Note: Newton–Schulz under tensor parallelism] in holder/_tp_ns) runs its NS on one rank of its
TP group, its TP owner, and the plan spreads the group's matrices over its ranks. Called one
at a time (gather, the owner's NS, scatter), they would run one after another across the
group: a matrix's scatter waits for its owner's NS, and the next matrix's gather waits behind
that scatter on the group's communicator, so the group would take the sum of every NS call.
Such an NS function is *staged* (:class:`StagedNS`): ``stages(batch)`` pauses where it waits
for its peers (gather issued; owner's NS done; scatter issued). The step hands those batches
to a :class:`StagedWindow`, which advances them in lockstep: every gather of the window is
issued before any owner computes, and every owner has computed before any scatter, so each
rank runs its own matrices' NS while the others run theirs. A window holds at most
``ns_batch_bytes`` of whole matrices on each owner (at least one matrix; ``None``: no cap)
and closes before a batch would pass that; the other batches run as they come. Every rank of
a group meets the same matrices in the same order, with the same owners and sizes, so all cut
the same windows and their collectives pair up. Each matrix's NS call is the one it had alone,
so the updates are bit for bit those of one matrix at a time.

[Note: non-finite gradients]
One NaN or infinity in any gradient would turn every weight it reaches non-finite: through NS
a single bad element spreads over a whole matrix. So ``Muon.step`` first checks every gradient
this rank is about to step with (the largest magnitude of each, one foreach launch), takes the
maximum over all ranks (one scalar all-reduce), and skips the whole step everywhere when
it is set: the Muon passes keep the old weight and momentum (one pass per matrix, see [Note:
fused momentum and update] in _fused), and AdamW runs torch's fused kernel with that
``found_inf``, which leaves parameters, moments and step counts untouched. The decision never
leaves the device (no host sync, as with GradScaler and a fused optimizer); the skip is counted
in ``Muon.last_step_stats``. With a finite gradient the Muon update is bit for bit the
unchecked step's, and AdamW runs torch's fused kernel either way (the same bits with the check
off, ``StepOptions(skip_nonfinite=False)``, as with it on and every gradient finite).

[Note: momentum convention]
``buf = momentum * buf + grad`` (no ``1 - momentum`` damping) and the Nesterov input
``grad + momentum * buf``. ``torch.optim.Muon`` keeps an exponential moving average instead
(``buf.lerp_(grad, 1 - momentum)``); its buffer is exactly ``(1 - momentum)`` times ours, and
because NS first divides by the Frobenius norm the orthogonalised updates agree (up to the
``eps`` of that normalisation).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Hashable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, TypeGuard, TypeVar, cast, runtime_checkable

import torch
from torch import Tensor
from torch.optim.adamw import adamw as _functional_adamw

from dmuon_ns import NewtonSchulz
from dmuon_ownership import Route

from .._checks import is_int
from .._matrix import MatrixView, NSFunction, matrices_of, matrix_shape
from .._profile import no_mark
from .._torch_internals import local_shard
from ..holder import DedicatedParam
from ._fused import DeviceScalars, advance_momentum, momentum_into, ns_input_into, update_weight

__all__ = [
    "Batches",
    "MuonItem",
    "NSFunction",
    "StagedNS",
    "StagedWindow",
    "StepScalars",
    "adamw_step",
    "finish_batch",
    "fresh_state",
    "grad_matrices",
    "init_adamw_state",
    "make_newton_schulz",
    "momentum_only",
    "momentum_update",
    "muon_batch",
    "muon_phase",
    "muon_step",
    "ns_inputs",
    "optim_dtype",
    "orthogonalized",
    "scalar_rows",
    "shape_batches",
    "step_dtype",
    "weight_decay_and_update",
]


def momentum_update(
    bufs: Sequence[Tensor],
    grads: Sequence[Tensor],
    outs: Sequence[Tensor],
    momentum: float,
    nesterov: bool,
    skip: Tensor | None = None,
    hp: DeviceScalars | None = None,
) -> None:
    """Advance each ``bufs[i]`` in place (``buf = momentum * buf + grad``, kept when ``skip``
    is set) and write its NS input into ``outs[i]``: ``grad + momentum * buf`` with Nesterov,
    ``buf`` without. All matrices have one shape; on CUDA one launch covers them (see [Note:
    one launch per batch] in _fused). The arithmetic is [Note: fused momentum and update]'s;
    ``hp`` hands the kernels ``momentum`` on the device ([Note: hyperparameters on the
    device])."""
    momentum_into(bufs, grads, outs, skip, momentum, nesterov, hp=hp)


def make_newton_schulz(ns_backend: str | NSFunction, ns_steps: int | None) -> NSFunction:
    """The NS function the optimizer uses: ``"gram"``/``"direct"`` build a ``NewtonSchulz``
    with ``ns_steps`` iterations (5 when ``None``); a ``NewtonSchulz`` instance or any other
    callable on a ``(batch, m, n)`` stack is used as given, and then ``ns_steps`` must be
    ``None`` (the callable carries its own)."""
    if callable(ns_backend):
        if ns_steps is not None:
            what = type(ns_backend).__name__ if isinstance(ns_backend, NewtonSchulz) else "callable"
            raise ValueError(
                f"ns_steps={ns_steps!r} was given with a {what} ns_backend, which runs its own "
                "iterations (a NewtonSchulz its steps=); drop ns_steps, or pass "
                "ns_backend='gram'/'direct'"
            )
        return ns_backend
    if ns_backend not in ("gram", "direct"):
        raise ValueError(
            f"ns_backend must be 'gram', 'direct', a dmuon_ns.NewtonSchulz or a callable"
            f" (batch, m, n) tensor -> tensor, got {ns_backend!r}"
        )
    steps = 5 if ns_steps is None else ns_steps
    if not is_int(steps) or steps < 1:
        raise ValueError(f"ns_steps must be a positive int (5 is standard), got {ns_steps!r}")
    return NewtonSchulz(backend=ns_backend, steps=steps)


class MuonItem(NamedTuple):
    """One owned Muon parameter for :func:`muon_batch`: where to read and write, and its
    hyperparameters. Tensors are laid out as the parameter (or this rank's TP shard of it):
    one matrix, or a stack of them (see [Note: what Muon steps] in _matrix)."""

    weight: Tensor  # updated in place
    grad: Tensor
    buf: Tensor  # momentum buffer, updated in place
    momentum: float
    nesterov: bool
    lr: float
    weight_decay: float
    scale: float  # MatrixView.lr_scale of each of its matrices
    view: MatrixView | None = None  # how its tensors split into matrices (None: matrices_of)


class StepScalars(NamedTuple):
    """What a graphed step's passes read on the device (see [Note: hyperparameters on the
    device] in _fused): ``values``, the rows of :func:`scalar_rows` of every item the phase
    steps; ``grad_offsets``, each gradient matrix's element offset from the ``anchors``
    tensor of its dtype, in the phase's matrix order; and where a part starts in them
    (``first`` item, ``first_matrix``): a part's items and matrices follow in order."""

    values: Tensor
    grad_offsets: Tensor
    anchors: Mapping[torch.dtype, Tensor]
    first: int
    first_matrix: int

    def rows(
        self, owners: Sequence[int], group: Sequence[int], *, grads: bool = False
    ) -> DeviceScalars:
        """The tables and each row of the matrices ``group`` (indices into ``owners``, the
        part's item of each matrix); with ``grads``, where their gradients are."""
        rows = [self.first + owners[i] for i in group]
        if not grads:
            return DeviceScalars(self.values, rows)
        grad_rows = [self.first_matrix + i for i in group]
        return DeviceScalars(self.values, rows, self.grad_offsets, grad_rows, self.anchors)


def grad_matrices(item: MuonItem) -> list[Tensor]:
    """``item``'s gradient matrices, in the order the passes take them."""
    return (matrices_of if item.view is None else item.view.matrices)(item.grad)


T = TypeVar("T")


def shape_batches(
    members: Sequence[T],
    key: Callable[[T], Hashable],
    size: Callable[[T], tuple[int, int]],
    max_batch_bytes: int | None,
) -> list[list[T]]:
    """``members`` grouped by ``key`` (the matrix shape, dtype and device of their NS input;
    first-seen order), each group cut into runs whose NS input stays within ``max_batch_bytes``
    (``size(member)``: its number of matrices and the bytes of one); a member larger than the
    cap runs alone, ``None`` lifts the cap. See [Note: one Newton–Schulz call per shape]."""
    groups: dict[Hashable, list[T]] = {}
    for member in members:
        groups.setdefault(key(member), []).append(member)
    runs: list[list[T]] = []
    for group in groups.values():
        run: list[T] = []
        used = 0
        for member in group:
            matrices, per_matrix = size(member)
            nbytes = matrices * per_matrix
            if run and max_batch_bytes is not None and used + nbytes > max_batch_bytes:
                runs.append(run)
                run, used = [], 0
            run.append(member)
            used += nbytes
        runs.append(run)
    return runs


def _item_rows_cols(item: MuonItem) -> tuple[int, int]:
    return matrix_shape(item.buf.shape) if item.view is None else item.view.matrix_shape


def _item_key(item: MuonItem) -> Hashable:
    return _item_rows_cols(item), item.buf.dtype, item.buf.device


def _item_size(item: MuonItem) -> tuple[int, int]:
    rows, cols = _item_rows_cols(item)
    return item.buf.numel() // (rows * cols), rows * cols * item.buf.element_size()


def muon_step(
    items: Sequence[MuonItem],
    ns: NSFunction,
    *,
    max_batch_bytes: int | None,
    skip: Tensor | None = None,
    mark: Callable[[str], None] = no_mark,
) -> None:
    """The Muon update of every item: momentum, NS batched by shape (see [Note: one
    Newton–Schulz call per shape]), decoupled weight decay and the scaled update.

    ``skip`` (a 0-d bool tensor) makes the step keep every weight and momentum buffer as it
    was when it is set, decided on the device; see [Note: non-finite gradients]. ``mark(name)``
    (the step profile) closes the phases "muon_update" and "ns[<batch shape>]"."""
    for part in shape_batches(items, _item_key, _item_size, max_batch_bytes):
        muon_batch(part, ns, skip=skip, mark=mark)
    mark("muon_update")


# The NS batches of a step, each with its plan index, items and NS function.
Batches = Sequence[tuple[int, list[MuonItem], NSFunction | None]]


def muon_phase(
    batches: Batches,
    momentum_parts: Sequence[list[MuonItem]],
    skip: Tensor | None,
    mark: Callable[[str], None],
    *,
    window_bytes: int | None = None,
    scalars: Callable[[int], StepScalars] | None = None,
    early: Callable[[int, list[MuonItem]], Tensor | None] | None = None,
) -> None:
    """The Muon phase of a step: momentum, NS and update of every batch (staged ones side by
    side, up to ``window_bytes`` on each holder: [Note: Newton–Schulz that waits for peers]),
    then the stacks of ``momentum_parts``, whose momentum alone advances here (another replica
    steps them). ``scalars(i)``: where the passes of the phase's ``i``-th part read their
    scalars and gradient offsets (the graphed phase's tables, parts in this order).
    ``early(index, items)``: the NS result of plan batch ``index`` computed during backward
    (``ns_overlap``), or ``None``; a batch that has one only advances its momentum and takes
    its update."""
    window = StagedWindow(window_bytes, skip, mark)
    for position, (index, items, ns) in enumerate(batches):
        assert ns is not None
        updates = None if early is None else early(index, items)
        if updates is not None:
            finish_batch(items, updates, skip=skip)
            continue
        part_scalars = None if scalars is None else scalars(position)
        if not window.add(items, ns, part_scalars):
            muon_batch(items, ns, skip=skip, mark=mark, scalars=part_scalars)
    window.flush()
    for position, items in enumerate(momentum_parts, len(batches)):
        momentum_only(items, skip, None if scalars is None else scalars(position))


def muon_batch(
    part: Sequence[MuonItem],
    ns: NSFunction,
    *,
    skip: Tensor | None = None,
    mark: Callable[[str], None] = no_mark,
    scalars: StepScalars | None = None,
) -> None:
    """Momentum, one NS call and the update for ``part``, whose matrices share one shape,
    dtype and device: each matrix's NS input is written straight into the stack. ``scalars``:
    the kernels read the hyperparameters there (the same values)."""
    batch, weights, owners = _momentum_stack(part, skip, scalars=scalars)
    mark("muon_update")
    updates = orthogonalized(ns, batch)
    mark(f"ns[{'x'.join(map(str, batch.shape))}]")
    del batch
    _update(part, weights, owners, updates, skip, scalars)
    del updates


@runtime_checkable
class StagedNS(Protocol):
    """An NS function that waits for peers; see [Note: Newton–Schulz that waits for
    peers]."""

    def __call__(self, batch: Tensor) -> Tensor:
        """The NS of ``batch``, run through at once."""
        ...

    @property
    def staged(self) -> bool:
        """Whether the step should run it beside others (the function may run plain)."""
        ...

    def holds(self, batch: Tensor) -> tuple[int, int]:
        """The rank that holds the whole of ``batch``'s matrices while they are
        orthogonalised, and their bytes."""
        ...

    def stages(self, batch: Tensor) -> Generator[None, None, Tensor]:
        """``self(batch)``, pausing wherever it waits for its peers."""
        ...


# Whether each NS function type implements StagedNS: a runtime protocol check costs about 8 µs,
# once per NS batch of every step otherwise.
_STAGED_TYPES: dict[type, bool] = {}


def _is_staged(ns: NSFunction) -> TypeGuard[StagedNS]:
    """Whether the step runs ``ns`` in a :class:`StagedWindow` (a :class:`StagedNS` that says
    so), the protocol checked once per type."""
    kind = type(ns)
    implements = _STAGED_TYPES.get(kind)
    if implements is None:
        implements = _STAGED_TYPES[kind] = isinstance(ns, StagedNS)
    return implements and cast(StagedNS, ns).staged


class _Staged(NamedTuple):
    part: Sequence[MuonItem]
    weights: list[Tensor]
    owners: list[int]
    scalars: StepScalars | None
    ns: NSFunction
    shape: torch.Size  # of the NS input
    stages: Generator[None, None, Tensor]


class StagedWindow:
    """Staged NS batches run side by side; see [Note: Newton–Schulz that waits for peers].
    ``add`` takes a batch whose NS is staged (and returns ``False`` for another), ``flush``
    finishes every batch taken."""

    def __init__(
        self,
        max_bytes: int | None,
        skip: Tensor | None,
        mark: Callable[[str], None] = no_mark,
    ) -> None:
        self.max_bytes = max_bytes
        self.skip = skip
        self.mark = mark
        self._held: dict[int, int] = {}  # bytes of whole matrices on each holder
        self._open: list[_Staged] = []
        self._done: dict[int, Tensor] = {}  # updates of the open batches that finished

    def add(
        self, part: Sequence[MuonItem], ns: NSFunction, scalars: StepScalars | None = None
    ) -> bool:
        if not _is_staged(ns):
            return False
        batch, weights, owners = _momentum_stack(part, self.skip, scalars=scalars)
        self.mark("muon_update")
        holder, nbytes = ns.holds(batch)
        held = self._held.get(holder, 0)
        if self._open and self.max_bytes is not None and held + nbytes > self.max_bytes:
            self.flush()
            held = 0
        self._held[holder] = held + nbytes
        staged = _Staged(part, weights, owners, scalars, ns, batch.shape, ns.stages(batch))
        del batch
        self._open.append(staged)
        self._advance(len(self._open) - 1)  # its first collective, before any batch waits
        return True

    def flush(self) -> None:
        """Advance every open batch one stage at a time, then update its weights."""
        while len(self._done) < len(self._open):
            for index in range(len(self._open)):
                self._advance(index)
        for index, staged in enumerate(self._open):
            updates = _checked(staged.ns, staged.shape, self._done.pop(index))
            self.mark(f"ns[{'x'.join(map(str, staged.shape))}]")
            _update(staged.part, staged.weights, staged.owners, updates, self.skip, staged.scalars)
        self._open, self._held = [], {}

    def _advance(self, index: int) -> None:
        if index not in self._done:
            try:
                next(self._open[index].stages)
            except StopIteration as done:
                self._done[index] = done.value


def orthogonalized(ns: NSFunction, batch: Tensor) -> Tensor:
    """``ns(batch)``, refused unless it has the batch's shape: an update of another shape
    would be broadcast into the weights (or fail deep in the update pass)."""
    return _checked(ns, batch.shape, ns(batch))


def _checked(ns: NSFunction, shape: torch.Size, updates: object) -> Tensor:
    if not isinstance(updates, Tensor) or updates.shape != shape:
        got = tuple(updates.shape) if isinstance(updates, Tensor) else type(updates).__name__
        raise ValueError(
            f"the Newton–Schulz function {ns!r} returned {got} for a (batch, m, n) input of"
            f" shape {tuple(shape)}; it must return a tensor of its input's shape (every"
            " matrix of the batch orthogonalised on its own)"
        )
    return updates


def ns_inputs(part: Sequence[MuonItem]) -> Tensor:
    """The NS input stack :func:`muon_batch` forms for ``part``, with every momentum buffer
    left as it is: the first half of a step split in two (see [Note: Newton–Schulz during
    backward] in _ns_overlap)."""
    return _momentum_stack(part, None, advance=False)[0]


def finish_batch(part: Sequence[MuonItem], updates: Tensor, *, skip: Tensor | None = None) -> None:
    """The second half: each momentum buffer advanced and each weight decayed and updated
    with ``updates`` (the NS of :func:`ns_inputs`), bit for bit as :func:`muon_batch` does
    (kept when ``skip`` is set)."""
    weights, grads, bufs, owners = _matrices(part)
    for (momentum, _), group in _grouped(owners, part, _momentum_key):
        advance_momentum([bufs[i] for i in group], [grads[i] for i in group], skip, momentum)
    _update(part, weights, owners, updates, skip)


def momentum_only(
    part: Sequence[MuonItem], skip: Tensor | None = None, scalars: StepScalars | None = None
) -> None:
    """Advance the momentum of ``part`` exactly as :func:`muon_batch` does, and nothing else:
    another replica steps these matrices (see [Note: stepping expert sources] in
    holder/_experts); their NS input is written to a scratch stack and dropped."""
    _momentum_stack(part, skip, scalars=scalars)


def _matrices(
    part: Sequence[MuonItem],
) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[int]]:
    """The weight, gradient and momentum matrices of ``part`` in stack order, and the index
    of the item each belongs to."""
    weights, grads, bufs, owners = [], [], [], []
    for index, item in enumerate(part):
        split = matrices_of if item.view is None else item.view.matrices
        matrices = split(item.buf)
        bufs += matrices
        grads += split(item.grad)
        weights += split(item.weight)
        owners += [index] * len(matrices)
    return weights, grads, bufs, owners


def _momentum_stack(
    part: Sequence[MuonItem],
    skip: Tensor | None,
    *,
    advance: bool = True,
    scalars: StepScalars | None = None,
) -> tuple[Tensor, list[Tensor], list[int]]:
    """Advance every momentum buffer of ``part`` (unless not ``advance``) and return the NS
    input stack, the weight matrices in its order and the index of the item each belongs
    to."""
    weights, grads, bufs, owners = _matrices(part)
    first = bufs[0]
    batch = torch.empty((len(bufs), *first.shape), dtype=first.dtype, device=first.device)
    rows = batch.unbind(0)  # every view at once: batch[i] one by one cost 0.12 µs a matrix more
    for (momentum, nesterov), group in _grouped(owners, part, _momentum_key):
        group_bufs = [bufs[i] for i in group]
        group_grads = [grads[i] for i in group]
        outs = [rows[i] for i in group]
        if advance:
            hp = None if scalars is None else scalars.rows(owners, group, grads=True)
            momentum_update(group_bufs, group_grads, outs, momentum, nesterov, skip=skip, hp=hp)
        else:
            ns_input_into(group_bufs, group_grads, outs, momentum, nesterov)
    return batch, weights, owners


def _update(
    part: Sequence[MuonItem],
    weights: Sequence[Tensor],
    owners: Sequence[int],
    updates: Tensor,
    skip: Tensor | None,
    scalars: StepScalars | None = None,
) -> None:
    """Decay and update every weight matrix with its row of ``updates``, one pass per
    hyperparameter group."""
    rows = updates.unbind(0)
    for (lr, weight_decay, scale), group in _grouped(owners, part, _update_key):
        weight_decay_and_update(
            [weights[i] for i in group],
            [rows[i] for i in group],
            lr=lr,
            weight_decay=weight_decay,
            scale=scale,
            skip=skip,
            hp=None if scalars is None else scalars.rows(owners, group),
        )


def _momentum_key(item: MuonItem) -> tuple[float, bool]:
    return item.momentum, item.nesterov


def _update_key(item: MuonItem) -> tuple[float, float, float]:
    return item.lr, item.weight_decay, item.scale


def _grouped(
    owners: Sequence[int], items: Sequence[MuonItem], key: Callable[[MuonItem], Any]
) -> Iterable[tuple[Any, list[int]]]:
    """The matrices' indices grouped by ``key`` of the item each belongs to (its
    hyperparameters), in first-seen order."""
    groups: dict[Any, list[int]] = {}
    for i, owner in enumerate(owners):
        groups.setdefault(key(items[owner]), []).append(i)
    return groups.items()


def weight_decay_and_update(
    params: Sequence[Tensor],
    updates: Sequence[Tensor],
    *,
    lr: float,
    weight_decay: float,
    scale: float,
    skip: Tensor | None = None,
    hp: DeviceScalars | None = None,
) -> None:
    """Decoupled weight decay ``p *= 1 - lr * wd`` and the step ``p -= lr * scale * update``, in
    place, in one pass per matrix (kept when ``skip`` is set, decided on the device), for
    matrices of one shape. The decay uses the unscaled ``lr``, as in torch.optim.Muon; the
    arithmetic is [Note: fused momentum and update]'s (in _fused); ``hp`` hands the kernels
    the decay and step on the device."""
    decay, step = _decay_and_step(lr, weight_decay, scale)
    update_weight(params, updates, skip, decay, step, hp=hp)


def _decay_and_step(lr: float, weight_decay: float, scale: float) -> tuple[float, float]:
    """The update pass's two scalars: it computes ``decay·p + step·update``."""
    return 1.0 - lr * weight_decay, -lr * scale


def scalar_rows(items: Iterable[MuonItem]) -> list[tuple[float, float, float]]:
    """Each item's ``(momentum, decay, step)``: the scalars its passes read from the device in
    a graphed step (see [Note: hyperparameters on the device] in _fused)."""
    return [
        (item.momentum, *_decay_and_step(item.lr, item.weight_decay, item.scale)) for item in items
    ]


def step_dtype() -> torch.dtype:
    # torch.optim.Adam keeps ``step`` in float64 only when that is the default dtype.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def init_adamw_state(param: Tensor, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """Fresh AdamW state laid out as torch.optim.AdamW lays it out (step on the CPU), the
    moments in ``dtype`` (``None``: the parameter's)."""
    return {
        "step": torch.tensor(0.0, dtype=step_dtype()),
        "exp_avg": torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format),
    }


# The state tensors each route keeps per parameter (fresh_state makes them).
STATE_FIELDS: dict[Route, tuple[str, ...]] = {
    Route.MUON: ("momentum_buffer",),
    Route.ADAMW: ("step", "exp_avg", "exp_avg_sq"),
}


def fresh_state(route: str, like: Tensor, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The optimizer state of a parameter laid out as ``like`` before its first step, states in
    ``dtype`` (``None``: ``like``'s): a zero momentum buffer for the Muon route, AdamW's
    moments and step (``init_adamw_state``) otherwise. ``Muon.step`` creates exactly this, and
    checkpoints write it for parameters not stepped yet."""
    if route == "muon":
        return {"momentum_buffer": torch.zeros_like(like, dtype=dtype)}
    return init_adamw_state(like, dtype)


def optim_dtype(dp: DedicatedParam | None) -> torch.dtype | None:
    """The dtype of a dedicated parameter's optimizer states (``None``: its tensor's), the
    ``dtype`` :func:`fresh_state` takes."""
    return None if dp is None else dp.optim_dtype


def adamw_step(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict[str, Tensor]],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    found_inf: Tensor | None = None,
) -> None:
    """One AdamW step through torch's fused AdamW kernel, so the numbers are those of
    ``torch.optim.AdamW(fused=True)`` with the same hyperparameters, whether or not the step
    checks for non-finite gradients. With ``found_inf`` (a 0-d float tensor, nonzero: skip) the
    kernel leaves parameters and states untouched when it is set, decided on the device, as with
    ``torch.amp.GradScaler``; see [Note: non-finite gradients]. A gradient in another dtype
    than its parameter (a dedicated weight's reduce dtype below its master's) is upcast
    first: see [Note: mixed precision] in ``holder/_precision``."""
    if not params:
        return
    grads = [g if g.dtype == p.dtype else g.to(p.dtype) for p, g in zip(params, grads)]
    for param, state in zip(params, states):
        # The fused kernel keeps ``step`` on the parameters' device (torch's own layout).
        if state["step"].device != param.device:
            state["step"] = state["step"].to(param.device, torch.float32)
    # AdamW is elementwise: stepping the local shards of DTensors is the same math.
    _functional_adamw(
        [local_shard(p) for p in params],
        [local_shard(g) for g in grads],
        [local_shard(s["exp_avg"]) for s in states],
        [local_shard(s["exp_avg_sq"]) for s in states],
        [],
        [s["step"] for s in states],
        foreach=False,
        fused=True,
        found_inf=found_inf,
        grad_scale=None,
        has_complex=any(torch.is_complex(p) for p in params),
        amsgrad=False,
        beta1=betas[0],
        beta2=betas[1],
        lr=lr,
        weight_decay=weight_decay,
        eps=eps,
        maximize=False,
    )
