"""Schedules that split each backward into the inputs' gradients and the weights'
(``ScheduleDualPipeV``, ``ScheduleInterleavedZeroBubble``) under bf16 compute with an fp32
reduce dtype: the weights' gradients, which the schedule computes with ``torch.autograd.grad``
and adds to ``.grad`` by hand, several in a row between two backwards, add up in the reduce
dtype, so each rank's local sums of the dedicated matrices are bit for bit those of
``ScheduleInterleaved1F1B`` (whose backwards accumulate them, see [Note: accumulating in the
reduce dtype] in holder/_precision) on the same four stages. pp 2 x dp 1 on 2 ranks.

The loss is taken in float32 of the stage's bf16 output: torch 2.11's ``mse_loss`` between a
bf16 input and a float32 target fails in its backward ("Found dtype Float but expected
BFloat16": its ``mse_loss_backward`` does not promote the dtypes, pytorch/pytorch#94086),
where torch 2.13's promotes them."""

from __future__ import annotations

import pytest
import torch
from test_pipeline import V_ON_GLOO, V_SKIP, WIDTH, _Block
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import (
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
)

from dmuon_fsdp import dedicate_params
from dmuon_testing.distributed import run_distributed

ROWS, STAGES = 8, 4
SCHEDULES = {
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "dual_pipe_v": ScheduleDualPipeV,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
}
# Where torch's V schedules do not run over gloo (V_SKIP), the others run without it.
RUN = [name for name in SCHEDULES if V_ON_GLOO or name != "dual_pipe_v"]


class _Part(nn.Module):
    """The blocks ``indices`` of the whole model, under their names: stage ``i`` of four is
    block ``i``, and ``_Part(0, 1, 2, 3)`` the whole model."""

    def __init__(self, *indices: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        blocks = [_Block() for _ in range(STAGES)]
        self.layers = nn.ModuleDict({str(i): blocks[i] for i in indices})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = block(x)
        return x


def _shard(part: _Part, dp, pp, mp: MixedPrecisionPolicy | None = None):
    """Dedicate (ZeRO-2, every 2-D weight) and ``fully_shard`` a part, its blocks first."""
    runtime = dedicate_params(
        part, dp, lambda n, p: p.ndim == 2, pipeline_mesh=pp, reshard_after_forward=False
    )
    policy = {} if mp is None else {"mp_policy": mp}
    for block in part.layers.values():
        fully_shard(block, mesh=dp, reshard_after_forward=False, **policy)
    fully_shard(part, mesh=dp, reshard_after_forward=False, **policy)
    return runtime


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, WIDTH, generator=gen), torch.randn(ROWS, WIDTH, generator=gen)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output.float(), target)


def _local_sums(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    """Per schedule of ``RUN``: this rank's dedicated ``.grad`` after one schedule step, by
    name."""
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    pp = mesh["pp"].get_local_rank()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    x, y = _batch()
    out = {}
    for name in RUN:
        kind = SCHEDULES[name]
        indices = (pp, STAGES - 1 - pp) if name == "dual_pipe_v" else (pp, pp + 2)
        parts = [_Part(index) for index in indices]
        runtimes = [_shard(part, mesh["dp"], mesh["pp"], mp) for part in parts]
        stages = [
            PipelineStage(part, index, STAGES, torch.device("cpu"), group=mesh["pp"].get_group())
            for part, index in zip(parts, indices, strict=True)
        ]
        schedule = kind(stages, n_microbatches=4, loss_fn=_loss)
        first, last = 0 in indices, STAGES - 1 in indices
        schedule.step(*([x] if first else []), **({"target": y} if last else {}))
        out[name] = {
            dp.fqn: dp.param.grad.detach().clone() for runtime in runtimes for dp in runtime.params
        }
    return out


@pytest.fixture(scope="module")
def local_sums() -> dict[str, dict[str, torch.Tensor]]:
    """Per schedule of ``RUN``: every rank's local sums, by name."""
    merged: dict[str, dict[str, torch.Tensor]] = {name: {} for name in RUN}
    for result in run_distributed(_local_sums, 2):
        for name, sums in result.items():
            merged[name].update(sums)
    return merged


@pytest.mark.distributed
@pytest.mark.parametrize(
    "name",
    [
        pytest.param("dual_pipe_v", marks=pytest.mark.skipif(not V_ON_GLOO, reason=V_SKIP)),
        "interleaved_zero_bubble",
    ],
)
def test_weight_gradients_written_by_hand_add_up_in_the_reduce_dtype(local_sums, name):
    want = local_sums["interleaved_1f1b"]
    assert len(want) == 2 * STAGES  # every stage's up and down
    got = local_sums[name]
    assert got.keys() == want.keys()
    for fqn, grad in got.items():
        assert grad.dtype == torch.float32, f"{name}: {fqn}'s local sum is {grad.dtype}"
        assert torch.equal(grad, want[fqn]), (
            f"{name}: {fqn}'s local sum is {(grad - want[fqn]).abs().max():.1e} away from"
            " interleaved 1F1B's"
        )
