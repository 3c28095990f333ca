"""Distributed Gram NS over column blocks on 2 gloo ranks vs the single-process result."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dmuon_ns import gram_newton_schulz, gram_newton_schulz_distributed
from dmuon_ns.testing import reference_newton_schulz, relative_error
from dmuon_testing.distributed import run_distributed

pytestmark = pytest.mark.distributed

# Uneven column blocks: rank 0 holds 70 columns, rank 1 the other 58.
SPLIT = (70, 58)


def _full(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _body(rank: int, world_size: int, shape, seed, restarts, zero) -> tuple[torch.Tensor, int]:
    full = torch.zeros(shape) if zero else _full(shape, seed)
    block = full.split(SPLIT, dim=-1)[rank]
    calls = []

    def all_reduce(t: torch.Tensor) -> None:
        assert t.dtype == torch.float32
        calls.append(tuple(t.shape))
        dist.all_reduce(t)

    out = gram_newton_schulz_distributed(block, all_reduce, steps=6, restart_iterations=restarts)
    assert out.shape == block.shape and out.dtype == block.dtype
    return out, len(calls)


@pytest.mark.parametrize(
    ("shape", "restarts"),
    [((32, 128), [2]), ((2, 24, 128), [2, 4]), ((40, 128), [])],
    ids=["2d", "batched-two-restarts", "no-restart"],
)
def test_matches_single_process(shape, restarts) -> None:
    results = run_distributed(_body, 2, shape, 7, restarts, False)
    out = torch.cat([r[0] for r in results], dim=-1)
    # One all-reduce for the first Gram matrix, one per restart.
    assert [r[1] for r in results] == [1 + len(restarts)] * 2
    g = _full(shape, 7)
    single = gram_newton_schulz(g, steps=6, restart_iterations=restarts)
    reference = reference_newton_schulz(g, steps=6, restart_iterations=restarts)
    err, err_single = relative_error(out, reference), relative_error(single, reference)
    assert err <= 1.5e-2 and err <= 3 * err_single, (err, err_single)
    # Both ranks run the same m×m iteration: the two blocks are consistent with one Q.
    assert relative_error(out, single) < 2 * max(err, err_single)


def test_zero_matrix() -> None:
    results = run_distributed(_body, 2, (16, 128), 0, None, True)
    assert all(torch.equal(r[0], torch.zeros_like(r[0])) for r in results)
