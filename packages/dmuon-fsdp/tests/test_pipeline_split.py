"""Schedules that split each backward into the inputs' gradients and the weights'
(``ScheduleDualPipeV``, ``ScheduleInterleavedZeroBubble``) under bf16 compute with an fp32
reduce dtype: the weights' gradients, which the schedule computes with ``torch.autograd.grad``
and adds to ``.grad`` by hand, several in a row between two backwards, add up in the reduce
dtype, so each rank's local sums of the dedicated matrices are bit for bit those of
``ScheduleInterleaved1F1B`` (whose backwards accumulate them, see [Note: accumulating in the
reduce dtype] in holder/_precision) on the same four stages. pp 2 x dp 1 on 2 ranks."""

from __future__ import annotations

import pytest
import torch
from test_pipeline import WIDTH, _Block
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


def _local_sums(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    """Per schedule: this rank's dedicated ``.grad`` after one schedule step, by name."""
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    pp = mesh["pp"].get_local_rank()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    x, y = _batch()
    out = {}
    for name, kind in SCHEDULES.items():
        indices = (pp, STAGES - 1 - pp) if name == "dual_pipe_v" else (pp, pp + 2)
        parts = [_Part(index) for index in indices]
        runtimes = [_shard(part, mesh["dp"], mesh["pp"], mp) for part in parts]
        stages = [
            PipelineStage(part, index, STAGES, torch.device("cpu"), group=mesh["pp"].get_group())
            for part, index in zip(parts, indices, strict=True)
        ]
        schedule = kind(stages, n_microbatches=4, loss_fn=nn.functional.mse_loss)
        first, last = 0 in indices, STAGES - 1 in indices
        schedule.step(*([x] if first else []), **({"target": y} if last else {}))
        out[name] = {
            dp.fqn: dp.param.grad.detach().clone() for runtime in runtimes for dp in runtime.params
        }
    return out


@pytest.mark.distributed
def test_weight_gradients_written_by_hand_add_up_in_the_reduce_dtype():
    per_rank = run_distributed(_local_sums, 2)
    merged: dict[str, dict[str, torch.Tensor]] = {name: {} for name in SCHEDULES}
    for result in per_rank:
        for name, sums in result.items():
            merged[name].update(sums)
    want = merged["interleaved_1f1b"]
    assert len(want) == 2 * STAGES  # every stage's up and down
    for name in ("dual_pipe_v", "interleaved_zero_bubble"):
        got = merged[name]
        assert got.keys() == want.keys()
        for fqn, grad in got.items():
            assert grad.dtype == torch.float32, f"{name}: {fqn}'s local sum is {grad.dtype}"
            assert torch.equal(grad, want[fqn]), (
                f"{name}: {fqn}'s local sum is {(grad - want[fqn]).abs().max():.1e} away from"
                " interleaved 1F1B's"
            )
