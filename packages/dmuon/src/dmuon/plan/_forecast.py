"""What dmuon will hold per rank and move per step at a topology, before the run.

[Note: the forecast]

:func:`forecast` takes a model config and a :class:`Topology`, builds the work items
(:func:`model_shapes`) and the owner plan (:func:`plan_owners`, the same call the runtime makes,
with the expert stacks as ``experts``), and adds up, per rank, what each of three setups
holds and moves; nothing is allocated.

- **dmuon**: the ``dedicated`` matrices on their owners, the rest on FSDP2 (experts stepped
  with Muon, each rank its own, or under HSDP by the plan's expert source for all replicas of
  a shard, which then broadcasts it; everything else with AdamW).
- **FSDP2 + AdamW**: every parameter sharded, AdamW everywhere (two moments).
- **FSDP2 + Muon**: every parameter sharded; each rank all-gathers the gradient of every
  dedicated matrix and orthogonalises all of them (a plain Muon on FSDP2); experts as in dmuon.

Sizes per rank (``G`` shard size, ``R`` replicas, ``T`` TP degree; an item's local size is its
elements over its ``tp``; ``c``, ``m``, ``o``, ``r`` the bytes per element of the param
(compute), master, optimizer-state and reduce dtypes):

- *kept between steps*: the parameters' masters, the optimizer states and, in HSDP, the
  replica copies, as the runtime allocates them; gradients, module buffers (rotary
  frequencies) and the weights unsharded for forward and backward are not in it. Masters: a
  rank's owned dedicated matrices whole (or its TP shard of them), and its FSDP2 shards as
  FSDP2 allocates them, every shard index padded to ``ceil(d0 / G)`` rows (chunk 0's size, so
  that all-gather inputs are equal). Optimizer states (Muon one buffer, AdamW two moments and
  its ``step``, a float32 scalar per tensor): of the owned matrices, and of the FSDP2 shards as
  ``DTensor.to_local()`` holds them, unpadded, ``torch.chunk``'s rows for the rank's shard
  index (``ceil(d0 / G)``, the last ones fewer or none). HSDP replica copies: the compute copy
  of the matrices the rank's shard column owns on other replicas (the publish target). Not
  counted: in HSDP with a compute dtype narrower than the master's, an owner also holds the
  compute copy of its own matrices from the publish (the end of a step) until their layer
  reshards again (after its forward with ZeRO-3, its backward with ZeRO-2), ``c`` per owned
  element.
- *unsharded for forward*: with ZeRO-3, one layer at a time: dmuon's peer buffers (the layer's
  dedicated matrices that the rank's shard index does not own, compute dtype) plus FSDP2's
  all-gathered rest of the layer (norms, experts), plus the root's FSDP2 parameters (embedding,
  final norm, head, held for the whole forward); ZeRO-2 keeps every layer until backward.
  Prefetch holds the next layer as well, up to twice the one-layer figure.
- *bytes per step*, per mesh axis and rank, in two units (see [Note: payload and wire bytes]):
  the *payload* of dmuon's own collectives (:attr:`Forecast.ranks`), and the bytes *received*
  (``traffic``), dmuon's derived from its payload, plus FSDP2's rounds over the other
  parameters. Shard axis: dmuon's matrices ``b·c`` per broadcast round (2 with ZeRO-3, 1
  with ZeRO-2) plus ``r`` for the reduce; FSDP2 the same rounds as all-gathers and a
  reduce-scatter, and FSDP2 + Muon one more all-gather of every dedicated gradient; replicate
  axis: dmuon's reduce and publish of the bytes its shard column owns (``r + c`` per
  element), FSDP2's all-reduce of its gradient shard, ``2(R−1)/R·r·b/G`` received; TP axis:
  dmuon's NS of each TP matrix as ``Topology.tp_ns`` chooses it (``StepOptions(tp_ns=)``'s
  rule, :func:`takes_gram`): gather (the TP owner receives ``(T−1)/T`` of a matrix's momentum
  and sends back the update; the others receive their ``1/T``, optimizer dtype) or
  distributed Gram NS (every rank of the group receives ``2(T−1)/T`` of each fp32
  ``short x short`` Gram matrix all-reduced, two per matrix), FSDP2 + Muon's all-gather of
  every TP-sharded gradient, nothing for AdamW.
- *optimizer work*: the planner's cost (:func:`ns_cost`, FLOP-equivalents, NS plus the
  elementwise pass) per rank, a TP matrix's as the runtime splits it (``_Forecaster.tp_work``:
  the pass on every rank's shard, NS on the TP owner or, under distributed Gram NS,
  :func:`gram_block_flops` on every rank), and the NS time of one step predicted from
  measured NS times ([Note: predicted NS times]), with same-shape matrices batched as ``Muon`` does (one call
  per shape, cut where the batch's momentum passes ``ns_batch_bytes``). A tensor-parallel
  matrix is orthogonalised in a call of its own (each has its own NS function, which ``Muon``
  batches with nothing): whole by its TP owner in gather mode, and under distributed Gram NS
  by every rank of its TP group as a ``short x long/T`` block, one call per matrix, timed by
  its FLOPs (:func:`gram_block_flops`: the iterations on the ``short x short`` Gram matrix run
  on every rank, also where ``long/T < short``); a weight with a declared split
  (``WorkItem.matrices``) as its pieces, each in the batch of its shape, and the planner
  charges it their cost, as ``dedicate_params`` does.
- *optimizer step time*: the NS time plus the step's elementwise passes, each memory-bound,
  at the table's streaming bandwidth. Per Muon element a rank steps: the non-finite check
  reads the gradient (``r``); the momentum pass reads the gradient and the buffer, writes the
  buffer and the NS input (``r + 3o``); the update reads the NS output and reads and writes
  the weight (``o + 2m``); ``2r + 4o + 2m`` bytes in all (16 in bf16). A rank steps what it
  holds: a TP matrix's shard on every rank of its TP group, whichever way its NS runs (NS
  gathers or all-reduces inside). NS's own reads and writes are in its measured times. Per AdamW element (FSDP2 shards): the check's read and
  the fused AdamW pass (gradient, weight, two moments read; weight and moments written),
  ``2r + 2m + 4o``. Host launch costs are left out, so a model of many small matrices runs
  slower than predicted.

Experts are FSDP2 parameters sharded on dim 0 with ``torch.chunk`` semantics: shard index ``s``
holds experts ``[s·k, (s+1)·k)`` of each stack, ``k = ceil(E / G)``, so with ``G`` not
dividing ``E`` (or ``G > E``) the last shard indices hold fewer or none, and the imbalance
cannot be planned away; the forecast says so.

[Note: payload and wire bytes]

The runtime's ``CommCounter`` counts, per rank and ``(axis, kind)``, the *payload* of each
collective it issues: the bytes of the tensor it carries, on every member of the group (a
broadcast's sender and receivers alike). :attr:`Forecast.ranks` predicts exactly that, per
rank and under the counter's keys (``"shard/broadcast"``, ``"shard/reduce"``,
``"replicate/reduce"``, ``"replicate/publish"``, ``"tp/gather"``, ``"tp/scatter"``,
``"tp/all_reduce"``), counted
from the shapes and the plan: per step, shard axis ``b·c`` per broadcast round and
``(b + k)·r`` for the reduce, ``b`` the elements of every dedicated matrix (all of them travel
on every rank of a row) and ``k`` their number (a reduce carries one presence flag per
matrix); replicate axis, on the ranks of shard index ``s``, the reduce (``r``, with the flags)
and the publish (``c``) of the elements that shard column owns; TP axis, on each rank of an owner
coordinate, the whole matrix (``o``) gathered and scattered for each TP matrix it owns in
gather mode, and two fp32 ``short x short`` Gram matrices all-reduced for each in Gram mode. A
collective on a group of one rank is never issued, so that axis counts nothing.

``traffic`` is the bytes a rank *receives*: on a group of ``n`` ranks, ``(n−1)/n`` of a
broadcast's, reduce's or publish's payload (the per-rank cost of a ring; ARCHITECTURE.md,
"Bytes per step"), and for a TP matrix ``(T−1)/T`` of the gather's payload on its TP owner,
``1/T`` of the scatter's on the others. dmuon's rows are derived from its payload; FSDP2's
rounds (the other parameters in the dmuon column, every parameter in the FSDP2 columns) are
counted the same way, but the runtime's counter does not see them, so only dmuon's payload can
be compared with a run (``dmuon.get_comm_ctx(model).counter``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from dmuon_ownership import (
    ExpertStack,
    Route,
    WorkItem,
    elementwise_cost,
    experts_held,
    ns_cost,
    plan_owners,
    tp_gram_pays,
)

from ._figures import ADAMW, DMUON, MUON, Forecast, RankFigures
from ._fit import Fit, fit_of
from ._gpus import GPU, TABLE_GPU, Links, resolve_gpu
from ._model_shapes import ITEMSIZE, ModelShapes, model_shapes, tp_dim_of
from ._ns_times import NSTimes, load_ns_times
from ._spread import Spread
from ._topology import Topology

__all__ = ["DEFAULT_NS_BATCH_BYTES", "expert_stack", "forecast"]

# Muon(ns_batch_bytes=) default in dmuon-fsdp: momentum bytes of one NS call.
DEFAULT_NS_BATCH_BYTES = 256 * 2**20
# AdamW's ``step``: a float32 scalar per parameter tensor (torch.optim.AdamW's layout).
ADAMW_STEP_BYTES = 4

_Member = tuple[int, int, int]  # one tensor's NS input: (matrices, rows, cols)


def _member(shape: tuple[int, ...], matrices: int | None = None) -> _Member:
    count = math.prod(shape[:-2]) if matrices is None else matrices
    return count, shape[-2], shape[-1]


# All-reduces of one distributed Gram NS with Muon's default NS (5 steps, a restart before
# step 2): the input's Gram matrix and the restart's ([Note: distributed Gram NS] in dmuon_ns).
GRAM_ALL_REDUCES = 2


def takes_gram(
    tp_ns: str, item: WorkItem, *, itemsize: int, steps: int = 5, restarts: int = 1
) -> bool:
    """Whether ``Muon(options=StepOptions(tp_ns=tp_ns))`` orthogonalises the tensor-parallel
    matrix ``item`` (its NS input in elements of ``itemsize`` bytes) by distributed Gram NS
    (its default NS is a Gram ``NewtonSchulz``): where the shards split the long side (either
    side of a square matrix), and under ``"auto"`` where ``tp_gram_pays``; see [Note:
    Newton–Schulz under tensor parallelism] in dmuon_fsdp."""
    if item.tp == 1 or tp_ns == "gather":
        return False
    split = tp_dim_of(item.name)
    if item.shape[1 - split] > item.shape[split]:
        return False
    short, long = sorted(item.shape)
    if tp_ns == "gram":
        return True
    return tp_gram_pays(short, long, item.tp, itemsize=itemsize, steps=steps, restarts=restarts)


def gram_block_flops(gram_side: int, block: int, steps: int = 5, restarts: int = 1) -> int:
    """FLOPs of distributed Gram NS on one rank's ``gram_side x block`` column block (Muon's
    default NS: 5 steps, one restart): :func:`ns_flops`' Gram form, with the Gram matrix on the
    side the shards do not split even where the block is narrower (it cannot be transposed:
    the all-reduced Gram matrix is ``gram_side²``)."""
    return 4 * gram_side**2 * block * (1 + restarts) + 8 * gram_side**3 * steps


def _members(item: WorkItem) -> list[_Member]:
    """The NS input of a dedicated matrix: itself, or a declared split's pieces
    (``WorkItem.matrices``), each in the batch of its own shape as ``Muon`` runs them."""
    return [_member(stack) for stack in item.stacks]


def expert_stack(item: WorkItem) -> ExpertStack:
    """How the runtime orthogonalises an expert stack ``(E, out, in)``: one matrix per expert,
    or, for a fused ``gate_up`` stack (rows ``[gate; up]``), gate and up apart."""
    experts, rows, cols = item.shape
    if "gate_up" in item.name:
        return ExpertStack(experts, rows // 2, cols, per_expert=2)
    return ExpertStack(experts, rows, cols)


def forecast(
    config: Mapping[str, Any] | str | os.PathLike[str] | ModelShapes,
    topology: Topology,
    *,
    small_param_threshold: int = 5_000_000,
    ns_batch_bytes: int | None = DEFAULT_NS_BATCH_BYTES,
    ns_times: NSTimes | None = None,
    gpu: GPU | str | float | None = None,
    bandwidth: Mapping[str, float] | None = None,
) -> Forecast:
    """Plan ``config`` (a parsed ``config.json``, its path, a model directory, or a
    :class:`ModelShapes`) on ``topology`` and add up what every rank holds, moves and computes.

    ``small_param_threshold`` is ``dedicate_params``'s, ``ns_batch_bytes`` ``Muon``'s (they
    shape the plan and the NS batches as in the run); ``ns_times`` is the table of measured NS
    times (default: the H200 one shipped with the package, scaled to ``gpu`` when that is
    another card). ``gpu`` (a :class:`GPU`, a name of ``GPUS`` such as ``"h100-80g"``, or a
    memory size in GiB) adds :attr:`Forecast.fit`: whether each setup fits on it and its step
    time with each mesh axis at the GPU's bandwidth, or at ``bandwidth``'s GB/s per axis
    (``{"replicate": 25.0}``). Allocates nothing; see [Note: the forecast] and [Note: the fit
    and the step time].

    Args:
        config: the model: a parsed Hugging Face ``config.json`` (a mapping), the path of that
            file or of the model directory holding it, or a :class:`ModelShapes` (made with
            ``tp`` equal to ``topology.tp``).
        topology: the cluster and sharding settings (:class:`Topology`).
        small_param_threshold: ``dedicate_params``'s option of that name, an int >= 0 in
            elements (matrices of one layer below it share one owner).
        ns_batch_bytes: ``StepOptions.ns_batch_bytes``, an int >= 1 (bytes of momentum in one
            NS call); ``None``: one NS call per shape.
        ns_times: the measured NS times predictions come from; ``None``: the H200 table
            shipped with the package (scaled to ``gpu``'s dense bf16 rate for another card).
        gpu: the card to fit on: a :class:`GPU`, the name of one in ``GPUS``
            (``"h100-80g"``, ``"h200"``, ...), or a memory size in GiB (a number > 0, with
            the H200's rates and links); ``None``: no fit verdict and no per-GPU step time.
        bandwidth: GB/s per mesh axis (keys ``"shard"``, ``"replicate"``, ``"tp"``, values
            > 0) overriding the GPU's links for the step-time prediction; ``None``: the
            GPU's NVLink inside a domain, InfiniBand across.
    """
    if not isinstance(topology, Topology):
        raise ValueError(
            f"forecast: topology must be a Topology, got {type(topology).__name__}; e.g. "
            "Topology(ranks=512, shard_size=64)"
        )
    shapes = (
        config
        if isinstance(config, ModelShapes)
        else model_shapes(config, tp=topology.tp, dtype=topology.master_dtype)
    )
    tp_degrees = {item.tp for item in shapes.all_items} - {1}
    if tp_degrees - {topology.tp}:
        raise ValueError(
            f"forecast: the ModelShapes were made for tp={sorted(tp_degrees)} but the topology "
            f"has tp={topology.tp}; build them with model_shapes(config, tp={topology.tp})"
        )
    if ns_batch_bytes is not None and (
        not isinstance(ns_batch_bytes, int)
        or isinstance(ns_batch_bytes, bool)
        or ns_batch_bytes < 1
    ):
        raise ValueError(
            "forecast: ns_batch_bytes must be an int >= 1 (bytes of momentum in one NS call, "
            f"Muon's option) or None for no cap, got {ns_batch_bytes!r}"
        )
    links: Links | None = None
    if gpu is not None:
        gpu = resolve_gpu(gpu)
        links = Links.on(gpu, topology.ranks, topology.shard, topology.tp, dict(bandwidth or {}))
    elif bandwidth is not None:
        raise ValueError(
            "forecast: bandwidth sets the mesh axes' GB/s on a GPU; give gpu= as well (e.g. "
            'gpu="h100-80g")'
        )
    table = ns_times or load_ns_times()
    if ns_times is None and gpu is not None and _rates(gpu) != _rates(TABLE_GPU):
        table = table.scaled(TABLE_GPU, gpu)
    forecaster = _Forecaster(shapes, topology, table, small_param_threshold, ns_batch_bytes)
    return forecaster.run(gpu, links)


def _rates(gpu: GPU) -> tuple[float, float]:
    return gpu.bf16_tflops, gpu.hbm_gb_s


class _Forecaster:
    """The arithmetic of one :func:`forecast` call."""

    def __init__(
        self,
        shapes: ModelShapes,
        topology: Topology,
        table: NSTimes,
        threshold: int,
        batch_bytes: int | None,
    ) -> None:
        self.shapes, self.topo, self.table = shapes, topology, table
        self.threshold, self.batch_bytes = threshold, batch_bytes
        self.G, self.R, self.T = topology.shard, topology.replicas, topology.tp
        self.c = ITEMSIZE[topology.param_dtype]
        self.m = ITEMSIZE[topology.master_dtype]
        assert topology.optim_dtype is not None and topology.reduce_dtype is not None
        self.o = ITEMSIZE[topology.optim_dtype]
        self.r = ITEMSIZE[topology.reduce_dtype]
        self._ms: dict[tuple[int, int, int], float] = {}

    # -- sizes ---------------------------------------------------------------------------------

    @staticmethod
    def local(item: WorkItem) -> int:
        """Elements of ``item`` on one TP rank."""
        return -(-item.numel // item.tp)

    def shard_numel(self, item: WorkItem) -> int:
        """Elements FSDP2 allocates for ``item`` on every rank: ``ceil(d0 / G)`` rows, the size
        of chunk 0, to which it pads every shard."""
        rows = -(-item.shape[0] // self.G) if item.shape else 1
        return -(-(rows * math.prod(item.shape[1:])) // item.tp)

    def chunk_numels(self, items: Iterable[WorkItem]) -> list[int]:
        """Elements of ``items`` per shard index as ``DTensor.to_local()`` holds them, unpadded:
        ``torch.chunk``'s rows of dim 0 (what FSDP2's optimizer states are made like). Items
        are grouped by shape so that a wide shard group costs one pass per distinct shape."""
        shapes: dict[tuple[int, int, int], int] = defaultdict(int)
        for item in items:
            rows = item.shape[0] if item.shape else 1
            shapes[(rows, math.prod(item.shape[1:]), item.tp)] += 1
        out = [0] * self.G
        for (rows, per_row, tp), count in shapes.items():
            for s in range(self.G):
                out[s] += count * -(-(experts_held(rows, s, self.G) * per_row) // tp)
        return out

    def experts_held(self, item: WorkItem, shard: int) -> int:
        """Experts of stack ``item`` that shard index ``shard`` holds (``torch.chunk``)."""
        return experts_held(item.shape[0], shard, self.G)

    # -- the plan ------------------------------------------------------------------------------

    def held(self, shard: int) -> tuple[int, ...]:
        """Experts of each stack that shard index ``shard`` holds; shard indices with equal
        holdings share every figure that depends on them."""
        return tuple(self.experts_held(item, shard) for item in self.shapes.experts)

    def expert_cost(self, held: tuple[int, ...]) -> float:
        """The NS work of the experts ``held``, as the runtime batches them: a fused gate/up
        stack is two matrices per expert (see expert_stack)."""
        return math.fsum(
            ns_cost((count * stack.per_expert, stack.rows, stack.cols), Route.MUON)
            for count, stack in zip(held, map(expert_stack, self.shapes.experts))
            if count
        )

    def run(self, gpu: GPU | None = None, links: Links | None = None) -> Forecast:
        G, R = self.G, self.R
        self.holdings = [self.held(s) for s in range(G)]
        costs = {held: self.expert_cost(held) for held in set(self.holdings)}
        shard_cost = [costs[held] for held in self.holdings]
        experts = [(item.name, expert_stack(item)) for item in self.shapes.experts]
        plan = plan_owners(
            self.shapes.dedicated,
            G,
            R,
            small_param_threshold=self.threshold,
            experts=experts or None,
        )
        self.plan = plan
        self.slot_of = {
            name: plan.slot_of(unit.owner) for unit in plan.units for name in unit.names
        }
        self.tp_owner = dict(plan.tp_owners)
        self.gram = {
            item.name
            for item in self.shapes.dedicated
            if takes_gram(
                self.topo.tp_ns,
                item,
                itemsize=self.o,
                steps=self.table.steps,
                restarts=self.table.restarts,
            )
        }
        state = self.rank_state()
        payload, tp_received = self.rank_payload()
        T = self.T
        ranks = tuple(
            RankFigures(slot // G, slot % G, t, payload[slot * T + t], state[slot])
            for slot in range(G * R)
            for t in range(T)
        )
        times = self.ns_time()
        figures = Forecast(
            shapes=self.shapes,
            topology=self.topo,
            plan=plan,
            ns_times=self.table,
            memory=self.memory(state),
            unsharded=self.unsharded(),
            traffic=self.traffic(payload, tp_received),
            work=self.work(shard_cost),
            ns_ms=times["ns_ms"],
            step_ms=times["step_ms"],
            ranks=ranks,
            notes=tuple(self.notes()),
        )
        if gpu is None or links is None:
            return figures
        return dataclasses.replace(figures, fit=self.fit(state, gpu, links))

    # -- on a GPU ------------------------------------------------------------------------------

    def fit(self, state: list[dict[str, int]], gpu: GPU, links: Links) -> Fit:
        """Every rank's memory terms, bytes received per axis and optimizer step ms (see
        [Note: the fit and the step time]), in rank order (slot-major, TP index minor)."""
        G, R, T = self.G, self.R, self.T
        count = G * R * T

        def by_slot(values: list[float]) -> list[float]:
            return [values[i // T] for i in range(count)]

        def by_shard(values: list[float]) -> list[float]:
            return [values[(i // T) % G] for i in range(count)]

        def uniform(value: float) -> list[float]:
            return [float(value)] * count

        owned = [0.0] * (G * R)  # the averaged gradients of the matrices each slot owns
        for item in self.shapes.dedicated:
            owned[self.slot_of[item.name]] += self.local(item) * self.r
        rest = self.shapes.fsdp + self.shapes.experts
        rest_grads = sum(self.shard_numel(item) for item in rest) * self.m
        all_grads = sum(self.shard_numel(item) for item in self.shapes.all_items) * self.m
        rows: dict[str, dict[str, list[float]]] = {
            DMUON: {
                "masters": by_slot([row["masters"] for row in state]),
                "optimizer states": by_slot([row["optimizer states"] for row in state]),
                "HSDP replica copies": by_slot([row["HSDP replica copies"] for row in state]),
                "gradients": by_slot([rest_grads + grads for grads in owned]),
                "unsharded weights": by_shard(self.peak[DMUON]),
                "unsharded gradients": uniform(self.layer_grads),
                **{axis: list(values) for axis, values in self.received.items()},
                "optimizer step": list(self.step_rows[DMUON]),
            }
        }
        for setup in (ADAMW, MUON):
            received = self.fsdp_received[setup]
            rows[setup] = {
                "masters": uniform(self.fsdp_masters),
                "optimizer states": by_shard(self.fsdp_states[setup]),
                "HSDP replica copies": uniform(0.0),
                "gradients": uniform(all_grads),
                "unsharded weights": uniform(self.peak[setup][0]),
                "unsharded gradients": uniform(self.layer_grads),
                **{axis: uniform(received[axis]) for axis in ("shard", "replicate", "tp")},
                "optimizer step": by_shard(self.step_rows[setup]),
            }
        return fit_of(rows, gpu, links)

    # -- memory kept between steps -------------------------------------------------------------

    def adamw_states(self, items: Iterable[WorkItem]) -> list[int]:
        """AdamW's state bytes per shard index of FSDP2 parameters ``items``: two moments of
        the unpadded shard, and the step scalar of every tensor (also of an empty shard)."""
        items = list(items)
        return [2 * self.o * n + len(items) * ADAMW_STEP_BYTES for n in self.chunk_numels(items)]

    def rank_state(self) -> list[dict[str, int]]:
        """What each slot of dmuon's grid keeps between steps, in bytes; see [Note: the
        forecast]. The ranks of one slot (its TP indices) keep the same."""
        G, R = self.G, self.R
        m, o, c = self.m, self.o, self.c
        fsdp_items = self.shapes.fsdp + self.shapes.experts
        fsdp_master = sum(self.shard_numel(it) for it in fsdp_items) * m
        experts = self.chunk_numels(self.shapes.experts)  # Muon's one buffer
        fsdp_states = [
            a + n * o for a, n in zip(self.adamw_states(self.shapes.fsdp), experts, strict=True)
        ]
        owned_master = [0] * (G * R)
        owned_states = [0] * (G * R)
        owned_copy = [0] * (G * R)
        for item in self.shapes.dedicated:
            slot = self.slot_of[item.name]
            size = self.local(item)
            owned_master[slot] += size * m
            if item.route is Route.MUON:
                owned_states[slot] += size * o
            else:
                owned_states[slot] += 2 * size * o + ADAMW_STEP_BYTES
            owned_copy[slot] += size * c
        column = [0] * G  # compute bytes owned by each shard index, over the replicas
        for slot, size in enumerate(owned_copy):
            column[slot % G] += size
        return [
            {
                "masters": fsdp_master + owned_master[slot],
                "optimizer states": fsdp_states[slot % G] + owned_states[slot],
                "HSDP replica copies": column[slot % G] - owned_copy[slot] if R > 1 else 0,
            }
            for slot in range(G * R)
        ]

    def memory(self, state: list[dict[str, int]]) -> dict[str, dict[str, Spread]]:
        keys = ("masters", "optimizer states", "HSDP replica copies")
        dmuon = {key: Spread.of(row[key] for row in state) for key in keys}
        dmuon["total"] = Spread.of(sum(row.values()) for row in state)
        every = self.shapes.all_items
        masters = sum(self.shard_numel(it) for it in every) * self.m
        adamw = self.adamw_states(every)
        muon_numel = self.chunk_numels(self.shapes.experts + self.shapes.dedicated)
        muon = [a + n * self.o for a, n in zip(self.adamw_states(self.shapes.fsdp), muon_numel)]
        self.fsdp_masters = float(masters)
        self.fsdp_states = {ADAMW: [float(x) for x in adamw], MUON: [float(x) for x in muon]}
        setups = {DMUON: dmuon}
        for name, states in ((ADAMW, adamw), (MUON, muon)):
            setups[name] = {
                "masters": Spread.uniform(masters),
                "optimizer states": Spread.of(states),
                "HSDP replica copies": Spread.uniform(0),
                "total": Spread.of(masters + x for x in states),
            }
        return setups

    # -- unsharded for forward -----------------------------------------------------------------

    def unsharded(self) -> dict[str, dict[str, Spread]]:
        G, c = self.G, self.c
        dedicated: dict[str, int] = defaultdict(int)  # boundary -> its dedicated matrices
        mine: dict[str, list[int]] = defaultdict(lambda: [0] * G)  # ... owned per shard index
        fsdp: dict[str, int] = defaultdict(int)  # boundary -> its FSDP2 parameters
        for item in self.shapes.dedicated:
            size = self.local(item) * c
            dedicated[item.boundary] += size
            mine[item.boundary][self.slot_of[item.name] % G] += size
        for item in self.shapes.fsdp + self.shapes.experts:
            fsdp[item.boundary] += self.local(item) * c
        root = fsdp.pop("", 0) + dedicated.pop("", 0)
        layers = sorted(set(dedicated) | set(fsdp))
        combine = max if self.topo.zero == 3 else sum

        def per_shard(with_fsdp: bool) -> list[float]:
            out = []
            for s in range(G):
                sizes = [
                    dedicated.get(b, 0)
                    - (mine[b][s] if b in mine else 0)
                    + (fsdp.get(b, 0) if with_fsdp else 0)
                    for b in layers
                ]
                held = float(combine(sizes)) if sizes else 0.0
                out.append(held + (root if with_fsdp else 0))
            return out

        whole = [dedicated.get(b, 0) + fsdp.get(b, 0) for b in layers]
        fsdp_all = float(combine(whole) if whole else 0) + root
        dmuon_all = per_shard(True)
        # With a GPU (see [Note: the fit and the step time]): ZeRO-3's prefetch holds a second
        # layer; in backward one layer's gradients and the root's wait for their reduction.
        layers_held = 2 if self.topo.zero == 3 else 1
        self.peak = {
            DMUON: [layers_held * (held - root) + root for held in dmuon_all],
            ADAMW: [layers_held * (fsdp_all - root) + root],
            MUON: [layers_held * (fsdp_all - root) + root],
        }
        self.layer_grads = float(max(whole, default=0) + root)
        return {
            DMUON: {
                "dmuon peer buffers": Spread.of(per_shard(False)),
                "all": Spread.of(dmuon_all),
            },
            ADAMW: {"dmuon peer buffers": Spread.uniform(0), "all": Spread.uniform(fsdp_all)},
            MUON: {"dmuon peer buffers": Spread.uniform(0), "all": Spread.uniform(fsdp_all)},
        }

    # -- bytes per step ------------------------------------------------------------------------

    def fsdp_bytes(
        self, items: Iterable[WorkItem], gather_grads: bool = False
    ) -> tuple[float, float]:
        """(shard axis, replicate axis) bytes per rank of FSDP2's rounds over ``items``."""
        G, R, c, r = self.G, self.R, self.c, self.r
        elements = sum(self.local(item) for item in items)
        gathers = 2 if self.topo.zero == 3 else 1
        per_element = gathers * c + r + (r if gather_grads else 0)
        shard = (G - 1) / G * elements * per_element
        replicate = 2 * (R - 1) / R * elements * r / G
        return shard, replicate

    def rank_payload(self) -> tuple[list[dict[str, int]], list[float]]:
        """Per rank (slot-major, TP index minor): the payload of dmuon's collectives in one
        step under ``CommCounter``'s keys, and the bytes it receives on the TP axis; see
        [Note: payload and wire bytes]."""
        G, R, T = self.G, self.R, self.T
        c, r, o = self.c, self.r, self.o
        rounds = 2 if self.topo.zero == 3 else 1
        elements = 0
        column = [0] * G  # elements owned by each shard index, over the replicas
        flags = [0] * G  # and their matrices: a reduce carries one presence flag per matrix
        tp_payload = [0] * (G * R)  # the whole TP matrices each owner coordinate gathers
        tp_gram = [0] * (G * R)  # and the Gram matrices it all-reduces
        tp_received = [0.0] * (G * R * T)
        for item in self.shapes.dedicated:
            slot = self.slot_of[item.name]
            size = self.local(item)
            elements += size
            column[slot % G] += size
            flags[slot % G] += 1
            if item.name in self.gram:
                gram = min(item.shape) ** 2 * 4 * GRAM_ALL_REDUCES  # fp32
                tp_gram[slot] += gram
                for t in range(T):
                    tp_received[slot * T + t] += 2 * (T - 1) / T * gram
            elif item.tp > 1:
                whole = size * item.tp * o
                tp_payload[slot] += whole
                owner = self.tp_owner[item.name]
                for t in range(T):
                    share = (T - 1) / T if t == owner else 1 / T
                    tp_received[slot * T + t] += share * whole
        # Expert sources: each stack shard one replica steps for all is broadcast over its
        # shard column in the stack's (master) dtype, a collective every replica joins.
        sourced = [0] * G
        stacks = {item.name: item for item in self.shapes.experts}
        for source in self.plan.expert_sources:
            item = stacks[source.stack]
            held = experts_held(item.shape[0], source.shard, G)
            sourced[source.shard] += held * math.prod(item.shape[1:]) * self.m
        payload = []
        for slot in range(G * R):
            counts = {}
            if G > 1:
                counts["shard/broadcast"] = rounds * elements * c
                counts["shard/reduce"] = (elements + sum(flags)) * r
            if R > 1:
                counts["replicate/reduce"] = (column[slot % G] + flags[slot % G]) * r
                counts["replicate/publish"] = column[slot % G] * c + sourced[slot % G]
            counts["tp/gather"] = counts["tp/scatter"] = tp_payload[slot]
            counts["tp/all_reduce"] = tp_gram[slot]
            nonzero = {key: value for key, value in counts.items() if value}
            payload += [nonzero] * T
        return payload, tp_received

    def traffic(
        self, payload: list[dict[str, int]], tp_received: list[float]
    ) -> dict[str, dict[str, Spread]]:
        G, R, T = self.G, self.R, self.T
        r = self.r
        dedicated = self.shapes.dedicated
        rest = self.shapes.fsdp + self.shapes.experts
        rest_shard, rest_replicate = self.fsdp_bytes(rest)
        # dmuon's received bytes from its payload: (n-1)/n of every collective on n ranks.
        shard = [
            (G - 1) / G * (p.get("shard/broadcast", 0) + p.get("shard/reduce", 0)) + rest_shard
            for p in payload
        ]
        replicate = [
            (R - 1) / R * (p.get("replicate/reduce", 0) + p.get("replicate/publish", 0))
            + rest_replicate
            for p in payload
        ]
        all_shard, all_replicate = self.fsdp_bytes(dedicated + rest)
        muon_shard, muon_replicate = self.fsdp_bytes(dedicated, gather_grads=True)
        tp_muon = sum((T - 1) / T * item.numel * r for item in dedicated if item.tp > 1)
        self.received = {"shard": shard, "replicate": replicate, "tp": tp_received}
        self.fsdp_received = {
            ADAMW: {"shard": all_shard, "replicate": all_replicate, "tp": 0.0},
            MUON: {
                "shard": muon_shard + rest_shard,
                "replicate": muon_replicate + rest_replicate,
                "tp": tp_muon,
            },
        }
        return {
            DMUON: {
                "shard": Spread.of(shard),
                "replicate": Spread.of(replicate),
                "tp": Spread.of(tp_received),
            },
            ADAMW: {
                "shard": Spread.uniform(all_shard),
                "replicate": Spread.uniform(all_replicate),
                "tp": Spread.uniform(0.0),
            },
            MUON: {
                "shard": Spread.uniform(muon_shard + rest_shard),
                "replicate": Spread.uniform(muon_replicate + rest_replicate),
                "tp": Spread.uniform(tp_muon),
            },
        }

    # -- optimizer work ------------------------------------------------------------------------

    def work(self, shard_cost: list[float]) -> dict[str, Spread]:
        plan, G = self.plan, self.G
        if plan.tp_loads:
            dmuon = [load for row in self.tp_work() for load in row]
        else:
            dmuon = list(plan.loads)
        everything = math.fsum(
            ns_cost(stack, item.route) for item in self.shapes.dedicated for stack in item.stacks
        )
        muon = [everything + shard_cost[s] for s in range(G)]
        adamw = [
            math.fsum(
                ns_cost((self.shard_numel(item),), Route.ADAMW) for item in self.shapes.all_items
            )
        ]
        return {DMUON: Spread.of(dmuon), ADAMW: Spread.of(adamw), MUON: Spread.of(muon)}

    def tp_work(self) -> list[list[float]]:
        """Each TP rank's work per slot as the runtime does it. The plan's ``tp_loads`` charge a
        TP matrix's whole cost to its TP owner (the plan is made before ``tp_ns`` is known);
        the runtime runs the momentum and update on every rank of the group over its shard,
        and NS whole on the TP owner in gather mode, or as Gram NS of a ``short x long/T`` block
        on every rank under distributed Gram NS."""
        T = self.T
        rows = [list(row) for row in self.plan.tp_loads]
        for item in self.shapes.dedicated:
            if item.tp == 1:
                continue
            row, owner = rows[self.slot_of[item.name]], self.tp_owner[item.name]
            whole = math.fsum(ns_cost(stack, item.route) for stack in item.stacks)
            ns = whole - elementwise_cost(item.numel, item.route)
            row[owner] -= whole
            for t in range(T):
                row[t] += elementwise_cost(item.numel // T, item.route)
            if item.name in self.gram and item.route is Route.MUON:
                short, long = sorted(item.shape)
                for t in range(T):
                    row[t] += gram_block_flops(short, long // T)
            else:
                row[owner] += ns
        return rows

    def predict(self, batch: int, rows: int, cols: int) -> float:
        key = (batch, rows, cols)
        if key not in self._ms:
            self._ms[key] = self.table.predict_ms(batch, rows, cols)
        return self._ms[key]

    def batched_ms(self, members: Iterable[_Member]) -> float:
        """Predicted NS time of ``members`` ``(matrices, rows, cols)`` batched as ``Muon``
        does: one call per matrix shape, cut where the momentum passes ``ns_batch_bytes``."""
        groups: dict[tuple[int, int], list[int]] = {}
        for matrices, rows, cols in members:
            groups.setdefault((rows, cols), []).append(matrices)
        total = 0.0
        for (rows, cols), counts in groups.items():
            per_matrix = rows * cols * self.o
            run = used = 0
            for matrices in counts:
                size = matrices * per_matrix
                if run and self.batch_bytes is not None and used + size > self.batch_bytes:
                    total += self.predict(run, rows, cols)
                    run = used = 0
                run += matrices
                used += size
            if run:
                total += self.predict(run, rows, cols)
        return total

    def ns_time(self) -> dict[str, dict[str, Spread]]:
        G, R, T = self.G, self.R, self.T
        expert_members = {
            held: [
                _member(item.shape, count)
                for count, item in zip(held, self.shapes.experts)
                if count
            ]
            for held in set(self.holdings)
        }
        owned: list[list[list[_Member]]] = [[[] for _ in range(T)] for _ in range(G * R)]
        gram_ms = [0.0] * (G * R)
        tp_ms = [0.0] * (G * R * T)
        for item in self.plan_order():
            slot = self.slot_of[item.name]
            if item.name in self.gram:
                # Every rank of the TP group orthogonalises its block in a call of its own,
                # the Gram matrix on the unsplit (short) side even where long/T is narrower.
                short, long = sorted(item.shape)
                gram_ms[slot] += self.table.ms_of_flops(
                    gram_block_flops(short, long // T, self.table.steps, self.table.restarts)
                )
                continue
            if item.tp > 1:  # whole on its TP owner, one matrix per call as well
                tp_ms[slot * T + self.tp_owner[item.name]] += self.predict(1, *item.shape)
                continue
            for t in range(T):
                owned[slot][t] += _members(item)
        # A stack shard another replica steps for all (an expert source) costs no NS here.
        elsewhere = {(s.stack, s.shard): s.replicate for s in self.plan.expert_sources}
        times: dict[tuple[tuple[_Member, ...], tuple[int, ...]], float] = {}
        dmuon = []
        for slot in range(G * R):
            shard, replicate = slot % G, slot // G
            stepped = tuple(
                count if elsewhere.get((item.name, shard), replicate) == replicate else 0
                for count, item in zip(self.holdings[shard], self.shapes.experts)
            )
            members = [
                _member(item.shape, count)
                for count, item in zip(stepped, self.shapes.experts)
                if count
            ]
            for t in range(T):
                key = (tuple(owned[slot][t]), stepped)
                if key not in times:
                    times[key] = self.batched_ms(owned[slot][t] + members)
                dmuon.append(times[key] + gram_ms[slot] + tp_ms[slot * T + t])
        every = [member for item in self.shapes.dedicated for member in _members(item)]
        per_holding = {
            held: self.batched_ms(every + expert_members[held]) for held in expert_members
        }
        muon = [per_holding[held] for held in self.holdings]
        # The elementwise passes: bytes per element in [Note: the forecast].
        r, o, m = self.r, self.o, self.m
        muon_ms = self.table.stream_ms(2 * r + 4 * o + 2 * m)
        adamw_ms = self.table.stream_ms(2 * r + 2 * m + 4 * o)
        rest = sum(self.shard_numel(it) for it in self.shapes.fsdp) * adamw_ms
        held_ms = {
            held: sum(
                count * math.prod(item.shape[1:]) for count, item in zip(held, self.shapes.experts)
            )
            * muon_ms
            for held in expert_members
        }
        # Every rank of the owner coordinate steps its own TP shard (the momentum and update
        # are elementwise), whichever way NS runs; a matrix that is not TP, whole on each.
        elements = [0] * (G * R)
        for item in self.shapes.dedicated:
            elements[self.slot_of[item.name]] += item.numel // item.tp
        step_dmuon = []
        for slot in range(G * R):
            for t in range(T):
                experts_ms = held_ms[self.holdings[slot % G]]
                step_dmuon.append(
                    dmuon[slot * T + t] + elements[slot] * muon_ms + experts_ms + rest
                )
        dense = sum(item.numel for item in self.shapes.dedicated) * muon_ms
        step_muon = [muon[s] + dense + held_ms[self.holdings[s]] + rest for s in range(G)]
        every_shard = sum(self.shard_numel(it) for it in self.shapes.all_items)
        self.step_rows = {
            DMUON: step_dmuon,
            ADAMW: [every_shard * adamw_ms] * G,
            MUON: step_muon,
        }
        return {
            "ns_ms": {
                DMUON: Spread.of(dmuon),
                ADAMW: Spread.uniform(0.0),
                MUON: Spread.of(muon),
            },
            "step_ms": {
                DMUON: Spread.of(step_dmuon),
                ADAMW: Spread.uniform(every_shard * adamw_ms),
                MUON: Spread.of(step_muon),
            },
        }

    def plan_order(self) -> list[WorkItem]:
        by_name = {item.name: item for item in self.shapes.dedicated}
        return [by_name[name] for name in self.plan.names]

    # -- notes ---------------------------------------------------------------------------------

    def notes(self) -> list[str]:
        notes: list[str] = []
        G = self.G
        counts = sorted({item.shape[0] for item in self.shapes.experts})
        for count in counts:
            chunk = -(-count // G)
            empty = sum(1 for s in range(G) if count - s * chunk <= 0)
            if count % G:
                notes.append(
                    f"experts: {count} per stack over a shard group of {G} (torch.chunk: "
                    f"{chunk} per shard index, {empty} of {G} shard indices hold none"
                    f"{'' if empty else ', the last fewer'}); a shard size that divides {count} "
                    "spreads them evenly"
                )
        if self.plan.imbalance > 0.05:
            balance = f"NS load max/mean is {1 + self.plan.imbalance:.3f}: "
            if any(note.startswith("experts:") for note in notes):
                notes.append(balance + "the experts' shares are uneven (above)")
            elif self.shapes.dedicated:
                largest = max(self.shapes.dedicated, key=lambda it: ns_cost(it.shape, it.route))
                mean = math.fsum(self.plan.loads) / len(self.plan.loads)
                share = ns_cost(largest.shape, largest.route) / mean
                notes.append(
                    balance + f"each matrix is owned whole, and one {largest.shape} matrix "
                    f"({largest.name.rsplit('.', 2)[-2]}) is {share:.0%} of a rank's mean load; "
                    "fewer slots (tensor parallelism) or more work per slot even it out"
                )
        if self.plan.expert_sources:
            sources = self.plan.expert_sources
            notes.append(
                f"expert sources: {len(sources)} expert stack shards on "
                f"{len({s.shard for s in sources})} shard indices are stepped by one replica "
                "for all and broadcast over the replicate axis (in the replicate publish row), "
                "to even out the owned matrices on top of the experts"
            )
        if self.topo.zero == 3:
            notes.append(
                "unsharded for forward: one layer; prefetching the next holds up to twice that"
            )
        return notes
