"""dmuon.clip_grad_norm_ against the real dmuon.Muon: the Muon-grad norm over owners equals the
norm of the full-batch gradients of the same matrices in one process, and clipping scales what
the next step reads; under tensor parallelism (FSDP2, HSDP and the replicated path) too, where a
matrix is split over ranks or kept whole by every TP grid."""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

import dmuon
from dmuon._demo_model import LlamaConfig, TinyLlama, muon_predicate
from dmuon_clip import MuonGradClipStats, register_muon_grad_clip_strategy
from dmuon_testing.distributed import run_distributed

CFG = LlamaConfig(vocab=64, hidden=32, intermediate=64, layers=2, heads=2, seq_len=8)
ROWS = 8  # global batch, split evenly over ranks


def _tokens() -> torch.Tensor:
    return torch.randint(
        0, CFG.vocab, (ROWS, CFG.seq_len), generator=torch.Generator().manual_seed(1)
    )


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, CFG.vocab), tokens[:, 1:].reshape(-1))


def _reference_muon_norm() -> float:
    torch.manual_seed(0)
    model = TinyLlama(CFG)
    _loss(model, _tokens()).backward()
    grads = [p.grad for n, p in model.named_parameters() if muon_predicate(n, p)]
    return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()


def _backward_on_ranks(
    cfg: LlamaConfig,
    rank: int,
    world_size: int,
    hsdp: bool = False,
    options=None,
    predicate=muon_predicate,
):
    """The demo model under dmuon and FSDP2 (1-D, or HSDP 2 × world/2) after one backward of
    this rank's rows, its Muon built with ``options``, its weights chosen by ``predicate``;
    (model, runtime, optimizer)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    torch.manual_seed(0)
    model = TinyLlama(cfg)
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
        runtime = dmuon.dedicate_params(
            model, mesh["shard"], predicate, replicate_mesh=mesh["replicate"]
        )
    else:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
        runtime = dmuon.dedicate_params(model, mesh, predicate)
    dedicated = dmuon.dedicated_params_of(model)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=dedicated)
    fully_shard(model, mesh=mesh, ignored_params=dedicated)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, options=options)
    rows = ROWS // world_size
    _loss(model, _tokens()[rank * rows : (rank + 1) * rows]).backward()
    return model, runtime, optimizer


def _clip_on_ranks(rank: int, world_size: int, max_norm: float) -> dict[str, object]:
    import dmuon

    _, _, optimizer = _backward_on_ranks(CFG, rank, world_size)
    before = [g.clone() for g in optimizer.muon_grads_for_clip().grads]
    stats = dmuon.clip_grad_norm_(optimizer, max_norm)
    after = optimizer.muon_grads_for_clip().grads
    ratios = [(a.norm() / b.norm()).item() for a, b in zip(after, before)]
    optimizer.step()  # the step consumes the clipped grads without error
    return {
        "total_norm": stats.total_norm.item(),
        "clip_coef": stats.clip_coef.item(),
        "owned": len(before),
        "ratios": ratios,
    }


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [4])
def test_muon_norm_over_owners_equals_full_batch_norm(world_size: int) -> None:
    expected = _reference_muon_norm()
    max_norm = expected / 4  # forces clipping
    results = run_distributed(_clip_on_ranks, world_size, max_norm)

    n_matrices = 7 * CFG.layers
    assert sum(r["owned"] for r in results) == n_matrices  # each matrix on exactly one owner
    for r in results:
        assert r["total_norm"] == pytest.approx(expected, rel=1e-5)
        assert r["clip_coef"] == pytest.approx(max_norm / (expected + 1e-6), rel=1e-5)
        for ratio in r["ratios"]:
            assert ratio == pytest.approx(r["clip_coef"], rel=1e-5)


# -- tensor parallelism ---------------------------------------------------------------------------

HEAD = "lm_head.weight"  # not tensor-parallel: every TP grid keeps the whole matrix
TOPOLOGIES = ("tp", "hsdp_tp", "ddp_tp")


def _with_head(name: str, p: torch.Tensor) -> bool:
    return muon_predicate(name, p) or name == HEAD


def _reference_adamw_norm() -> float:
    """The full-batch norm of the gradients the AdamW route steps (the norms, the embedding)."""
    torch.manual_seed(0)
    model = TinyLlama(CFG)
    _loss(model, _tokens()).backward()
    grads = [p.grad.double() for n, p in model.named_parameters() if not _with_head(n, p)]
    return math.sqrt(sum(float(g.square().sum()) for g in grads))


def _reference_clipped(max_norm: float) -> tuple[float, dict[str, torch.Tensor]]:
    """The full-batch Muon gradients of one process, clipped as torch.nn.utils would."""
    torch.manual_seed(0)
    model = TinyLlama(CFG)
    _loss(model, _tokens()).backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if _with_head(n, p)}
    norm = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
    coef = min(max_norm / (norm + 1e-6), 1.0)
    return norm, {n: g * coef for n, g in grads.items()}


def _tp_model(topology: str):
    """The demo model with TP degree 2 on 4 ranks: (dp 2, tp 2) with FSDP2, (replicate 2,
    shard 1, tp 2) with HSDP, or (dp 2, tp 2) on the replicated path; and its data-parallel
    index (of 2)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    import dmuon
    from dmuon._demo_train import TP_PLAN

    torch.manual_seed(0)
    model = TinyLlama(CFG)
    hsdp = topology == "hsdp_tp"
    shape, names = ((2, 1, 2), ("replicate", "shard", "tp")) if hsdp else ((2, 2), ("dp", "tp"))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], TP_PLAN)
    # The head has no layer boundary: the root module hooks it.
    options = {"hook_boundary_strict": False, "small_param_threshold": 0}
    if topology == "ddp_tp":
        runtime = dmuon.dedicate_params_ddp(model, mesh["dp"], _with_head, **options)
        dmuon.replicate(model, mesh["dp"])
    else:
        dp_mesh = mesh["replicate", "shard"] if hsdp else mesh["dp"]
        runtime = dmuon.dedicate_params(
            model,
            mesh["shard"] if hsdp else mesh["dp"],
            _with_head,
            replicate_mesh=mesh["replicate"] if hsdp else None,
            **options,
        )
        dedicated = dmuon.dedicated_params_of(model)
        for layer in model.layers:
            fully_shard(layer, mesh=dp_mesh, ignored_params=dedicated)
        fully_shard(model, mesh=dp_mesh, ignored_params=dedicated)
    coord = runtime.coord
    return model, runtime, coord.replicate * runtime.layout.shard_size + coord.shard


def _clip_tp_on_ranks(rank: int, world_size: int, max_norm: float) -> dict[str, dict]:
    import dmuon

    out = {}
    for topology in TOPOLOGIES:
        model, runtime, dp_index = _tp_model(topology)
        optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
        rows = ROWS // 2
        _loss(model, _tokens()[dp_index * rows : (dp_index + 1) * rows]).backward()
        # A matrix's own norm needs its TP shards: refused before anything is scaled, naming
        # the first (in group order) Muon matrix split over the TP ranks.
        before = [g.clone() for g in optimizer.muon_grads_for_clip().grads]
        split = {dp.fqn for dp in runtime.params if dp.tp_dim is not None}
        first = next(name for name in optimizer.muon_param_names() if name in split)
        assert optimizer.param_split_over_ranks() == first
        named = rf"the gradient of '{re.escape(first)}' \(a tensor-parallel matrix"
        with pytest.raises(ValueError, match=named):
            dmuon.clip_grad_norm_(optimizer, max_norm, strategy="per_matrix")
        after = optimizer.muon_grads_for_clip().grads
        untouched = all(torch.equal(a, b) for a, b in zip(before, after))
        adamw = dmuon.clip_grad_norm_(optimizer, None, params="adamw").total_norm.item()
        stats = dmuon.clip_grad_norm_(optimizer, max_norm)
        owned = [dp for dp in runtime.owned if dp.route == "muon"]
        out[topology] = {
            "total_norm": stats.total_norm.item(),
            "clip_coef": stats.clip_coef.item(),
            "param_count": stats.param_count,
            "grads": {dp.fqn: (dp.grad.clone(), dp.tp_dim) for dp in owned},
            "tp_index": runtime.layout.tp_index,
            "untouched": untouched,
            "adamw": adamw,
        }
        optimizer.step()
    return out


@pytest.mark.distributed
def test_tensor_parallel_clip_counts_each_element_once_and_clips_like_one_process() -> None:
    expected, _ = _reference_clipped(1.0)
    max_norm = expected / 4  # forces clipping
    _, clipped = _reference_clipped(max_norm)
    adamw = _reference_adamw_norm()
    results = run_distributed(_clip_tp_on_ranks, 4, max_norm)
    for topology in TOPOLOGIES:
        held: dict[str, list[int]] = {}
        for r in results:
            got = r[topology]
            assert got["untouched"], f"{topology}: the refused per_matrix call scaled grads"
            assert got["total_norm"] == pytest.approx(expected, rel=1e-5), topology
            assert got["clip_coef"] == pytest.approx(max_norm / (expected + 1e-6), rel=1e-5)
            assert got["param_count"] == len(got["grads"])
            # Every TP grid keeps the parameters laid out without the TP dim: counted once.
            assert got["adamw"] == pytest.approx(adamw, rel=1e-5), topology
            for fqn, (grad, tp_dim) in got["grads"].items():
                want = clipped[fqn]
                if tp_dim is not None:
                    size = grad.shape[tp_dim]
                    want = want.narrow(tp_dim, got["tp_index"] * size, size)
                # Shards and whole copies alike hold the reference's clipped gradient.
                torch.testing.assert_close(grad.double(), want, rtol=1e-5, atol=1e-8)
                held.setdefault(fqn, []).append(got["tp_index"])
        # One owner per TP grid for every matrix: its shard, or (the head) a whole copy.
        assert {n: sorted(t) for n, t in held.items()} == {n: [0, 1] for n in clipped}, topology


# -- per-matrix clipping of expert stacks under HSDP ---------------------------------------------

MOE = dataclasses.replace(CFG, experts=4)


# Two q projections (32, 32) declared as fused [q; k; v] weights (2 query heads, 1 key/value
# head of 8 rows): Muon steps their pieces as matrices of their own, and so does the clip. The
# row blocks each piece's matrices span, in order: q, k and v, or one matrix per head.
SPLITS = {
    "layers.0.self_attn.q_proj.weight": (dmuon.MatrixSplit(2, 1), (16, 8, 8)),
    "layers.1.self_attn.q_proj.weight": (dmuon.MatrixSplit(2, 1, per_head=True), (8,) * 4),
}


def _split_predicate(name: str, p: torch.Tensor) -> bool | dmuon.MatrixSplit:
    return SPLITS[name][0] if name in SPLITS else muon_predicate(name, p)


def _per_matrix_reference(max_norm: float) -> dict[str, torch.Tensor]:
    """The full-batch Muon gradients of one process, each matrix (each expert of a stack,
    each piece of a split weight, cut by hand) clipped by its own norm."""
    torch.manual_seed(0)
    model = TinyLlama(MOE)
    _loss(model, _tokens()).backward()
    out = {}
    for n, p in model.named_parameters():
        if muon_predicate(n, p):
            g = p.grad.double()
            blocks = g.split(list(SPLITS[n][1])) if n in SPLITS else [g]
            clipped = []
            for block in blocks:
                norms = torch.linalg.vector_norm(block, dim=(-2, -1), keepdim=True)
                clipped.append(block * torch.clamp(max_norm / (norms + 1e-6), max=1.0))
            out[n] = torch.cat(clipped)
    return out


def _per_matrix_on_ranks(rank: int, world_size: int, max_norm: float) -> dict[str, torch.Tensor]:
    model, runtime, optimizer = _backward_on_ranks(
        MOE, rank, world_size, hsdp=True, predicate=_split_predicate
    )
    dmuon.clip_grad_norm_(optimizer, max_norm, strategy="per_matrix")
    # Each replica's expert gradients as that replica holds them (gathered over its shards),
    # and the dense matrices this rank owns.
    got = {
        n: p.grad.redistribute(placements=[p.grad.placements[0], Replicate()]).to_local()
        for n, p in model.named_parameters()
        if ".experts." in n
    }
    got |= {dp.fqn: dp.grad.clone() for dp in runtime.owned if dp.route == "muon"}
    return got


@pytest.mark.distributed
def test_per_matrix_clips_every_expert_and_every_piece_alone_on_every_replica() -> None:
    # Every rank holds two of a stack's four experts; the second replica's shards are copies
    # (the first counts them). Each expert must end as one process clips it alone, and each
    # piece of a split weight (q, k, v; or each head) as if it were a weight of its own.
    want = _per_matrix_reference(1.0)
    norms = sorted(float(torch.linalg.vector_norm(g)) for g in want.values())
    max_norm = norms[len(norms) // 2] / 20  # clips most matrices, by different factors
    want = _per_matrix_reference(max_norm)
    results = run_distributed(_per_matrix_on_ranks, 4, max_norm)
    seen = set()
    for got in results:
        for name, grad in got.items():
            torch.testing.assert_close(grad.double(), want[name], rtol=1e-5, atol=1e-9)
            seen.add(name)
    assert seen == set(want)


# -- params: which gradients ------------------------------------------------------------------

TO_ADAMW = "layers.0.self_attn.o_proj.weight"  # dedicated, stepped by AdamW on its owner
POLICY = {"overrides": [{"name": [TO_ADAMW], "set": {"route": "adamw"}}]}


def _route_of(name: str, p: torch.Tensor) -> str:
    return "muon" if muon_predicate(name, p) and name != TO_ADAMW else "adamw"


def _reference_norms() -> dict[str, float]:
    """One process, the full batch: the 2-norm of each route's gradients, of both, and of the
    dedicated weights' (every selected matrix but the expert stacks)."""
    torch.manual_seed(0)
    model = TinyLlama(MOE)
    _loss(model, _tokens()).backward()
    sets: dict[str, list[torch.Tensor]] = {"muon": [], "adamw": [], "all": [], "held": []}
    for n, p in model.named_parameters():
        g = p.grad.double()
        sets[_route_of(n, p)].append(g)
        sets["all"].append(g)
        if muon_predicate(n, p) and ".experts." not in n:
            sets["held"].append(g)
    return {
        k: float(torch.linalg.vector_norm(torch.stack([g.norm() for g in v])))
        for k, v in sets.items()
    }


def _moe_after_backward(rank: int, world_size: int):
    """The MoE demo model with o_proj on AdamW (POLICY), 1-D FSDP2 and dmuon, after one
    backward of this rank's rows: (model, optimizer)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    torch.manual_seed(0)
    model = TinyLlama(MOE)
    mesh = init_device_mesh("cpu", (world_size,))
    dmuon.dedicate_params(model, mesh, muon_predicate, param_policy=POLICY)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    rows = ROWS // world_size
    _loss(model, _tokens()[rank * rows : (rank + 1) * rows]).backward()
    return model, optimizer


def _params_on_ranks(rank: int, world_size: int, max_norms: dict[str, float]) -> dict[str, float]:
    """For each selection: its norm, then the norms of every selection after clipping it."""
    import dmuon

    out: dict[str, float] = {}
    for params, max_norm in max_norms.items():
        model, optimizer = _moe_after_backward(rank, world_size)
        chosen = dmuon.dedicated_params_of(model) if params == "held" else params
        out[params] = dmuon.clip_grad_norm_(optimizer, max_norm, params=chosen).total_norm.item()
        for after in ("muon", "adamw"):
            norm = dmuon.clip_grad_norm_(optimizer, None, params=after).total_norm.item()
            out[f"{params}, then {after}"] = norm
        optimizer.step()  # the step reads the clipped gradients
    return out


@pytest.mark.distributed
def test_each_selection_is_clipped_once_by_its_own_norm() -> None:
    # An expert stack is an FSDP2 parameter on the Muon route, a dedicated weight may take the
    # AdamW route on its owner: each selection holds exactly its gradients, each counted once.
    want = _reference_norms()
    max_norms = {k: want[k] / 4 for k in ("muon", "adamw", "all", "held")}
    results = run_distributed(_params_on_ranks, 2, max_norms)
    for got in results:
        for params in max_norms:
            assert got[params] == pytest.approx(want[params], rel=1e-5), params
        # Clipping one route scales it to max_norm and leaves the other as it was.
        assert got["muon, then muon"] == pytest.approx(max_norms["muon"], rel=1e-5)
        assert got["muon, then adamw"] == pytest.approx(want["adamw"], rel=1e-5)
        assert got["adamw, then adamw"] == pytest.approx(max_norms["adamw"], rel=1e-5)
        assert got["adamw, then muon"] == pytest.approx(want["muon"], rel=1e-5)
        # One coefficient for both: each keeps its share.
        share = max_norms["all"] / want["all"]
        assert got["all, then muon"] == pytest.approx(want["muon"] * share, rel=1e-5)
        assert got["all, then adamw"] == pytest.approx(want["adamw"] * share, rel=1e-5)


def _clamped_reference() -> tuple[float, dict[str, float]]:
    """One process, the full batch: a clip value below each route's largest gradient element,
    and each route's norm after every gradient is clamped to it."""
    torch.manual_seed(0)
    model = TinyLlama(MOE)
    _loss(model, _tokens()).backward()
    routes: dict[str, list[torch.Tensor]] = {"muon": [], "adamw": []}
    for n, p in model.named_parameters():
        routes[_route_of(n, p)].append(p.grad.double())
    value = 0.5 * min(max(float(g.abs().max()) for g in gs) for gs in routes.values())
    norms = {
        route: float(
            torch.linalg.vector_norm(torch.stack([g.clamp(-value, value).norm() for g in gs]))
        )
        for route, gs in routes.items()
    }
    return value, norms


def _value_clip_on_ranks(rank: int, world_size: int, value: float) -> dict[str, float]:
    import dmuon

    _, optimizer = _moe_after_backward(rank, world_size)
    dmuon.clip.clip_grad_value_(optimizer, value, params="all")
    held = optimizer.grads_for_clip("all")
    largest = max(float(g.abs().max()) for g in [*held.grads, *held.copies] if g.numel())
    out = {
        r: dmuon.clip_grad_norm_(optimizer, None, params=r).total_norm.item()
        for r in ("muon", "adamw")
    }
    optimizer.step()
    return {**out, "largest": largest}


@pytest.mark.distributed
def test_clip_grad_value_clamps_every_gradient_where_it_is_kept() -> None:
    # torch.nn.utils.clip_grad_value_ never sees a dedicated matrix's gradient (it lives on the
    # owner, not in param.grad): dmuon's clamps both routes, as torch's would in one process.
    value, want = _clamped_reference()
    for got in run_distributed(_value_clip_on_ranks, 2, value):
        assert got["largest"] <= value
        for route in ("muon", "adamw"):
            assert got[route] == pytest.approx(want[route], rel=1e-5), route


def _bad_params(rank: int, world_size: int) -> None:
    import dmuon

    options = dmuon.StepOptions(ns_overlap=True)
    model, _, optimizer = _backward_on_ranks(CFG, rank, world_size, options=options)
    overlap = optimizer._overlap
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="pass 'muon', 'adamw', 'all'"):
            dmuon.clip_grad_norm_(optimizer, 1.0, params="experts")
        stranger = torch.nn.Parameter(torch.ones(2, 2))
        grad = next(p.grad for p in model.parameters() if p.grad is not None)
        for wrong in ([stranger], [grad], [model.norm.weight.detach()]):
            with pytest.raises(ValueError, match="not a parameter of this optimizer"):
                dmuon.clip_grad_norm_(optimizer, 1.0, params=wrong)
            # max_norm=inf scales nothing, but the selection is still checked.
            with pytest.raises(ValueError, match="not a parameter of this optimizer"):
                dmuon.clip.clip_grads_with_norm_(optimizer, math.inf, 1.0, params=wrong)
        with pytest.raises(ValueError, match=r"pass params=module\.parameters\(\)"):
            dmuon.clip_grad_norm_(optimizer, 1.0, params=model)
        # FSDP2 shards every AdamW parameter: the refusal names the first (in group order).
        assert optimizer.param_split_over_ranks("muon") is None
        for params, routes in (("adamw", ("adamw",)), ("all", ("muon", "adamw"))):
            name = next(
                n
                for g in optimizer.param_groups
                if g["optimizer"] in routes
                for n in g["param_names"]
                if isinstance(model.get_parameter(n), DTensor)
            )
            assert optimizer.param_split_over_ranks(params) == name
            named = rf"this rank sees .* the gradient of '{re.escape(name)}'"
            with pytest.raises(ValueError, match=named):
                dmuon.clip_grad_norm_(optimizer, 1.0, params=params, strategy="per_matrix")
        # No fast path on the CPU: declined before the take, with the Muon group or without;
        # another group is refused there too.
        group = optimizer.runtime.global_group
        assert optimizer.clip_group_and_device("all") == (group, torch.device("cpu"))
        shards = [p.grad.to_local() for p in model.parameters() if hasattr(p.grad, "to_local")]
        try_clip = dmuon.clip.try_clip_optimizer_grad_norm_buckets_
        for to in (None, group):
            kept = try_clip(
                optimizer, regular_grads=shards, adamw_grads=[], max_norm=1e-3, process_group=to
            )
            assert kept is None
        other = torch.distributed.new_group()
        with pytest.raises(ValueError, match="process_group must be None or the group"):
            try_clip(optimizer, regular_grads=[], adamw_grads=[], max_norm=1.0, process_group=other)
    # Refused (or declined) before the gradients were taken: NS during backward stays on
    # (taking them had turned it off, with a warning), and the step is the one without these
    # calls.
    assert optimizer._overlap is overlap and overlap is not None and not caught
    optimizer.step()
    used = torch.tensor([overlap.used])
    torch.distributed.all_reduce(used)
    assert used.item() > 0  # NS results of backward were used
    plain, _, untouched = _backward_on_ranks(CFG, rank, world_size, options=options)
    untouched.step()
    want = dmuon.get_model_state_dict(plain)
    for name, value in dmuon.get_model_state_dict(model).items():
        assert torch.equal(value, want[name]), name
    # One parameter, as torch's clip takes it: a dedicated matrix (whole on its owner alone)
    # and an FSDP2 one.
    for one in (model.layers[0].mlp.gate_proj.weight, model.layers[0].input_layernorm.weight):
        norm = dmuon.clip_grad_norm_(optimizer, None, params=one).total_norm
        assert torch.equal(norm, dmuon.clip_grad_norm_(optimizer, None, params=[one]).total_norm)
        assert norm > 0


@pytest.mark.distributed
def test_params_that_are_not_the_optimizers_are_refused() -> None:
    run_distributed(_bad_params, 2)


def _users_per_matrix(
    grads: list[torch.Tensor],
    max_norm: float | None,
    norm_type: float,
    process_group: object,
    device: torch.device,
) -> MuonGradClipStats:
    """A user's strategy registered with ``per_matrix=True``: written for matrices (a stack's
    last two dims), each clipped by its own 2-norm; it raises for a gradient of fewer dims."""
    assert max_norm is not None and norm_type == 2.0
    if any(g.ndim < 2 for g in grads):
        raise AssertionError(f"a per-matrix strategy got shapes {[g.shape for g in grads]}")
    norms = [torch.linalg.vector_norm(g.double(), dim=(-2, -1), keepdim=True) for g in grads]
    for g, norm in zip(grads, norms):
        g.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(g.dtype))
    total = torch.cat([n.reshape(-1) for n in norms] or [torch.zeros(0)]).norm().float()
    one, no = torch.ones((), device=device), torch.zeros((), dtype=torch.bool, device=device)
    return MuonGradClipStats(total, one, no, no.clone(), len(grads))


def _per_tensor_adamw_on_the_replicated_path(
    rank: int, world_size: int, max_norm: float, strategy: str
) -> dict[str, torch.Tensor]:
    """The AdamW gradients on the replicated path after a per-matrix clip (the built-in one or
    a user's): whole tensors there (norms and biases 1-D), each clipped by its own norm, on
    every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon

    if strategy == "users":
        register_muon_grad_clip_strategy(
            strategy, _users_per_matrix, overwrite=True, per_matrix=True
        )

    torch.manual_seed(0)
    model = TinyLlama(CFG)
    mesh = init_device_mesh("cpu", (world_size,))
    dmuon.dedicate_params_ddp(model, mesh, muon_predicate, small_param_threshold=0)
    dmuon.replicate(model, mesh)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    rows = ROWS // world_size
    _loss(model, _tokens()[rank * rows : (rank + 1) * rows]).backward()
    # The user's strategy takes the same selection as a generator, as torch's clip takes
    # model.parameters(): read once, it must not be used up by the per-matrix check.
    params: Any = "adamw"
    if strategy == "users":
        params = (p for n, p in model.named_parameters() if not muon_predicate(n, p))
    dmuon.clip_grad_norm_(optimizer, max_norm, params=params, strategy=strategy)
    return {n: p.grad.clone() for n, p in model.named_parameters() if not muon_predicate(n, p)}


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["per_matrix", "users"])
def test_per_matrix_clips_each_adamw_tensor_whole_on_the_replicated_path(strategy: str) -> None:
    torch.manual_seed(0)
    model = TinyLlama(CFG)
    _loss(model, _tokens()).backward()
    max_norm = 0.05
    want = {}
    for name, p in model.named_parameters():
        if not muon_predicate(name, p):
            coef = min(max_norm / (float(p.grad.double().norm()) + 1e-6), 1.0)
            want[name] = p.grad.double() * coef
    assert any(v.ndim == 1 for v in want.values())
    for got in run_distributed(_per_tensor_adamw_on_the_replicated_path, 2, max_norm, strategy):
        assert got.keys() == want.keys()
        for name, grad in got.items():
            torch.testing.assert_close(grad.double(), want[name], rtol=1e-5, atol=1e-9)


# A compiled function that calls backward() on an FSDP2 model fails inside FSDP2 on torch 2.11
# (plain FSDP2 + torch.optim.AdamW alike) and trains on 2.13, as dmuon-fsdp's test_compile says.
BACKWARD_COMPILES = tuple(int(v) for v in re.findall(r"\d+", torch.__version__)[:2]) >= (2, 13)
COMPILED_MAX_NORM = 0.05  # below the Muon-grad norm of both steps: the clip scales
# dmuon-clip's entry points that take the optimizer.
CLIP_ENTRY_POINTS = (
    "clip_grad_norm_",
    "clip_grads_with_norm_",
    "clip_grad_value_",
    "try_clip_optimizer_grad_norm_buckets_",
)


def _clip_train_step(model, optimizer):
    """The train step of torch's clip habit: zero_grad, backward, clip, step; (loss, the Muon
    norm the clip measured)."""
    import dmuon

    def step(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        optimizer.zero_grad()
        loss = _loss(model, tokens)
        loss.backward()
        total = dmuon.clip_grad_norm_(optimizer, COMPILED_MAX_NORM).total_norm
        optimizer.step()
        return loss.detach(), total

    return step


def _compiled_clip_on_ranks(rank: int, world_size: int) -> dict[str, Any]:
    """Each entry point that takes the optimizer, compiled with ``fullgraph=True`` (what it
    raised), and a compiled train step that clips (its and the eager step's losses and norms,
    dynamo's graph breaks, and the graph nodes traced from dmuon-clip's or dmuon-fsdp's code)."""
    import os

    import torch._dynamo.utils as dynamo_utils

    import dmuon
    import dmuon_clip
    import dmuon_fsdp

    sources = [os.path.dirname(m.__file__) for m in (dmuon_clip, dmuon_fsdp)]
    out: dict[str, Any] = {"traced": []}

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        for node in gm.graph.nodes:
            stack = node.meta.get("stack_trace") or ""
            if any(source in stack for source in sources):
                out["traced"].append(stack)
        return gm.forward

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    _, _, optimizer = _backward_on_ranks(CFG, rank, world_size)
    calls = {
        "clip_grad_norm_": lambda: dmuon.clip_grad_norm_(optimizer, 1.0),
        "clip_grads_with_norm_": lambda: dmuon.clip.clip_grads_with_norm_(optimizer, 1.0, 2.0),
        "clip_grad_value_": lambda: dmuon.clip.clip_grad_value_(optimizer, 1.0),
        "try_clip_optimizer_grad_norm_buckets_": lambda: (
            dmuon.clip.try_clip_optimizer_grad_norm_buckets_(
                optimizer, regular_grads=[], adamw_grads=[], max_norm=1.0
            )
        ),
    }
    for name, call in calls.items():
        try:
            torch.compile(call, backend=backend, fullgraph=True)()
            out[name] = "did not raise"
        except Exception as error:  # dynamo's Unsupported
            out[name] = str(error)
    if BACKWARD_COMPILES:
        rows = ROWS // world_size
        shares = [_tokens()[r * rows : (r + 1) * rows] for r in range(world_size)]
        batches = [shares[rank], shares[world_size - 1 - rank]]  # two steps, two batches
        model, _, optimizer = _backward_on_ranks(CFG, rank, world_size)
        compiled = torch.compile(_clip_train_step(model, optimizer), backend=backend)
        out["compiled"] = [[float(t) for t in compiled(tokens)] for tokens in batches]
        out["breaks"] = dict(dynamo_utils.counters["graph_break"])
        model, _, optimizer = _backward_on_ranks(CFG, rank, world_size)
        eager = _clip_train_step(model, optimizer)
        out["eager"] = [[float(t) for t in eager(tokens)] for tokens in batches]
    return out


@pytest.mark.distributed
def test_the_clip_runs_eagerly_under_compile_and_fullgraph_names_the_fix() -> None:
    # [Note: the clip under torch.compile]. Before: a compiled train step traced the clip and
    # the optimizer's muon_grads_for_clip in pieces (16 graph breaks on non-tensor values and 2
    # at Work.wait over two steps, 63 graph nodes from dmuon-clip's and dmuon-fsdp's code), and
    # fullgraph=True raised an error that named a private torch call inside dmuon-clip.
    for got in run_distributed(_compiled_clip_on_ranks, 2):
        for name in CLIP_ENTRY_POINTS:
            shown = "dmuon.clip_grad_norm_" if name == "clip_grad_norm_" else f"dmuon.clip.{name}"
            assert f"{shown} runs eagerly under torch.compile" in got[name], (name, got[name])
            assert "outside the compiled function" in got[name], (name, got[name])
        assert not got["traced"], got["traced"][:3]
        if BACKWARD_COMPILES:
            assert got["compiled"] == got["eager"], (got["compiled"], got["eager"])
            assert all(norm > COMPILED_MAX_NORM for _, norm in got["eager"]), got["eager"]
            ours = [r for r in got["breaks"] if "dmuon_clip" in r or "dmuon.clip" in r]
            assert len(ours) == 1 and "runs eagerly under torch.compile" in ours[0], ours
