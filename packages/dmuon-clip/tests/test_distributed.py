"""gloo on CPU, 2 and 4 ranks: the Muon norm across owners equals the single-process norm of the
full-batch gradient, with one collective; a non-finite bucket on one rank is flagged on all."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist
from _fake import FakeMuon
from _reference import assert_close, float64_norm, torch_clip

from dmuon_clip import GradClipBucket, clip_grad_norm_, clip_grad_norm_buckets_, clip_grad_value_
from dmuon_testing.distributed import run_distributed

pytestmark = pytest.mark.distributed

# Our accumulator is fp32 (the model is float64): norms and coefficients agree to fp32 rounding.
RTOL = 1e-6
BATCH = 16


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    dims = [6, 12, 12, 8, 8, 3]
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(dims)):
        layers.append(torch.nn.Linear(a, b, bias=False))
        if i < len(dims) - 2:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers).double()


def _grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


class _CountingAllReduce:
    def __init__(self) -> None:
        self.calls = 0
        self.inner = dist.all_reduce

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


def _muon_body(rank: int, world_size: int, norm_type: float, max_norm: float | None) -> float:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 6, generator=gen, dtype=torch.float64)
    y = torch.randn(BATCH, 3, generator=gen, dtype=torch.float64)
    model = _model()
    full = _grads(model, x, y)  # the single-process, full-batch reference
    ref_total, ref_clipped = torch_clip(full, max_norm, norm_type)

    shard = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    local = _grads(model, x[shard], y[shard])
    owners = [i % max(world_size - 1, 1) for i in range(len(local))]  # the last rank owns none
    owned_idx = []
    for i, g in enumerate(local):
        dist.reduce(g, dst=owners[i], op=dist.ReduceOp.SUM)  # the runtime's reduce to the owner
        if owners[i] == rank:
            g.div_(world_size)
            owned_idx.append(i)
    owned = [local[i] for i in owned_idx]
    for i, g in zip(owned_idx, owned):
        # The averaged grad is the full-batch grad up to float64 summation order.
        assert float((g - full[i]).abs().max()) <= 1e-12 * float(full[i].abs().max())

    counter = _CountingAllReduce()
    dist.all_reduce = counter  # type: ignore[assignment]
    try:
        stats = clip_grad_norm_(
            FakeMuon(owned, process_group=dist.group.WORLD), max_norm, norm_type
        )
    finally:
        dist.all_reduce = counter.inner
    assert counter.calls == 1
    assert stats.param_count == len(owned)
    assert_close(stats.total_norm.double(), ref_total, rtol=RTOL)
    for i, g in zip(owned_idx, owned):
        assert_close(g, ref_clipped[i], rtol=RTOL)
    return float(stats.total_norm)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(("norm_type", "max_norm"), [(2.0, 0.05), (math.inf, 0.01), (2.0, None)])
def test_muon_norm_across_owners_equals_full_batch(
    world_size: int, norm_type: float, max_norm: float | None
) -> None:
    totals = run_distributed(_muon_body, world_size, norm_type, max_norm)
    assert len(set(totals)) == 1  # every rank got the same norm


def _rank_grads(rank: int) -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    return {
        "a": [torch.randn(5, 7, generator=gen), torch.randn(3, generator=gen)],
        "b": [torch.randn(4, 4, generator=gen)] if rank % 2 == 0 else [],
        "poison": [torch.randn(6, generator=gen)],
        "local": [torch.randn(9, generator=gen) * (rank + 1)],
    }


def _buckets_body(rank: int, world_size: int, norm_type: float) -> list[bool]:
    mine = _rank_grads(rank)
    if rank == 1:
        mine["poison"][0][2] = math.nan
    everyone = [_rank_grads(r) for r in range(world_size)]
    before = {n: [g.clone() for g in gs] for n, gs in mine.items()}
    counter = _CountingAllReduce()
    dist.all_reduce = counter  # type: ignore[assignment]
    try:
        result = clip_grad_norm_buckets_(
            [
                GradClipBucket("local", mine["local"], reduce=False),
                GradClipBucket("a", mine["a"]),
                GradClipBucket("poison", mine["poison"]),
                GradClipBucket("b", mine["b"]),
            ],
            {"local": 1.0, "a": 1.0, "poison": 1.0, "b": None},
            norm_type=norm_type,
            process_group=dist.group.WORLD,
        )
    finally:
        dist.all_reduce = counter.inner
    assert counter.calls == 1
    for name in ("a", "b"):
        want = float64_norm([g for r in everyone for g in r[name]], norm_type)
        assert float(result[name].total_norm) == pytest.approx(want, rel=RTOL)
    local_want = float64_norm(before["local"], norm_type)
    assert float(result["local"].total_norm) == pytest.approx(local_want, rel=RTOL)
    # "a" is clipped by its global norm, "local" by this rank's own, "b" only measured.
    for name in ("a", "local"):
        coef = float(result[name].clip_coef)
        want_coef = min(1.0, 1.0 / (float(result[name].total_norm) + 1e-6))
        assert coef == pytest.approx(want_coef, rel=RTOL)
        for got, old in zip(mine[name], before[name]):
            assert_close(got, old * result[name].clip_coef, rtol=0)
    assert all(torch.equal(g, o) for g, o in zip(mine["b"], before["b"]))
    # NaN on rank 1 only: every rank flags the bucket and leaves it alone.
    assert bool(result["poison"].found_inf) and float(result["poison"].clip_coef) == 1.0
    for got, old in zip(mine["poison"], before["poison"]):
        assert_close(got, old, rtol=0, equal_nan=True)
    return [bool(s.found_inf) for s in result.bucket_stats]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_buckets_one_collective_and_nonfinite_isolated(world_size: int, norm_type: float) -> None:
    flags = run_distributed(_buckets_body, world_size, norm_type)
    assert flags == [[False, False, True, False]] * world_size


def _raise_body(rank: int, world_size: int, strategy: str) -> str:
    gen = torch.Generator().manual_seed(200 + rank)
    owned = [torch.randn(5, 7, generator=gen), torch.randn(2, 4, 3, generator=gen)]
    if rank == world_size - 1:
        owned[1][0, 0, 0] = math.nan  # one rank's gradient only
    try:
        clip_grad_norm_(
            FakeMuon(owned, process_group=dist.group.WORLD),
            1.0,
            error_if_nonfinite=True,
            strategy=strategy,
        )
    except RuntimeError as err:
        return str(err)
    return ""


@pytest.mark.parametrize("strategy", ["global_norm", "per_matrix"])
def test_a_nonfinite_norm_on_one_rank_raises_on_every_rank(strategy: str) -> None:
    # "per_matrix" finds it on that rank alone; the others would step on and wait for it.
    messages = run_distributed(_raise_body, 2, strategy)
    assert all("non-finite on some rank" in m for m in messages), messages


def _value_body(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 + rank), dtype=torch.float64)
    twins = []
    for _ in range(2):  # one for torch's clip_grad_value_, one for ours
        model = _model()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model(x).square().sum().backward()
        twins.append([p.grad for p in model.parameters()])
    ours, theirs = twins
    assert all(isinstance(g, DTensor) for g in ours)
    torch.nn.utils.clip_grad_value_([p for p in _with_grads(theirs)], 0.05)
    clip_grad_value_(FakeMuon(ours, process_group=dist.group.WORLD), 0.05)
    for got, want in zip(ours, theirs, strict=True):
        assert isinstance(got, DTensor) and torch.equal(got.to_local(), want.to_local())
    assert max(float(g.to_local().abs().max()) for g in ours) == 0.05  # something was clamped

    full = torch.linspace(-1.0, 1.0, 12, dtype=torch.float64).reshape(3, 4)
    replicated = distribute_tensor(full, mesh, [Replicate()])
    clip_grad_value_(FakeMuon([replicated], process_group=dist.group.WORLD), 0.5)
    assert torch.equal(replicated.to_local(), full.clamp(-0.5, 0.5))

    # Summands 0.4 on each rank: their sum (0.8 on two ranks) is above 0.5, each summand is not.
    local = torch.full((3, 4), 0.4, dtype=torch.float64)
    partial = DTensor.from_local(local, mesh, [Partial()])
    before = [g.to_local().clone() for g in ours]
    with pytest.raises(ValueError, match="is a DTensor with a Partial placement"):
        clip_grad_value_(FakeMuon([*ours, partial], process_group=dist.group.WORLD), 0.05)
    assert torch.equal(local, torch.full((3, 4), 0.4, dtype=torch.float64))
    assert all(torch.equal(g.to_local(), b) for g, b in zip(ours, before, strict=True))


def _with_grads(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Parameters whose ``.grad`` are ``grads`` (torch's clip takes parameters)."""
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.empty_like(g))
        p.grad = g
        params.append(p)
    return params


def test_clip_grad_value_clamps_dtensor_grads_as_torch_and_refuses_partial_ones() -> None:
    # FSDP2's Shard gradients bit for bit as torch.nn.utils.clip_grad_value_ clamps them, a
    # Replicate one on every rank alike; a Partial one raises and nothing is clamped.
    run_distributed(_value_body, 2)
