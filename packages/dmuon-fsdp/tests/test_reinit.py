"""A new default process group (``destroy_process_group`` then ``init_process_group``, as a
sweep or a notebook does) gets dmuon groups of its own: the groups made under the destroyed
one are dropped, not kept (they hold threads and sockets) nor taken for the new one's (see
[Note: isolated groups are made once]). A model built under the destroyed group stops with one
error naming the fix, on every rank (see [Note: a destroyed process group])."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _reference import Hyper, lm_loss, make_batch, shard
from _sgd_train import setup_model
from torch import nn

from dmuon_fsdp import Muon, get_model_state_dict
from dmuon_fsdp.topology import _comm
from dmuon_testing.distributed import run_distributed

DESTROYED = "built under a default process group that has since been destroyed"


def _refuse_each_call(model: nn.Module, optimizer: Muon, tokens: torch.Tensor) -> None:
    """A model built under a destroyed default group, still alive: its forward, step,
    checkpoint call and a new Muon each stop with one error naming the fix (before: torch's
    "Process group <...> is not initialized in the world group map" at the forward and the
    state dict, and a step that ran)."""
    calls: list[Callable[[], object]] = [
        lambda: lm_loss(model, tokens),
        optimizer.step,
        lambda: get_model_state_dict(model),
        lambda: Muon(model, **Hyper().muon_kwargs()),
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match=DESTROYED):
            call()


def _cycles(rank: int, world_size: int, root: str) -> None:
    finals = []
    earlier = None
    for cycle in range(3):
        if cycle:
            dist.destroy_process_group()
            store = dist.FileStore(f"{root}/store-{cycle}", world_size)
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
            )
        model, _ = setup_model(world_size)
        optimizer = Muon(model, **Hyper().muon_kwargs())
        lm_loss(model, shard(make_batch(0, 8, 8, 32), rank, world_size)).backward()
        optimizer.step()
        if earlier is not None:  # the last cycle's model, under the new default group
            _refuse_each_call(*earlier, shard(make_batch(1, 8, 8, 32), rank, world_size))
        earlier = (model, optimizer)
        if cycle:  # (the first cycle's world may hold earlier tests' layouts)
            kept = len(_comm._ISOLATED)
            assert kept == 1, f"cycle {cycle}: {kept} layouts kept"
        assert _comm._MADE_UNDER[0] is dist.group.WORLD
        finals.append(get_model_state_dict(model))
    # Each cycle trains the same model from the same start: the same weights.
    assert all(torch.equal(finals[0][k], f[k]) for f in finals[1:] for k in finals[0])


@pytest.mark.distributed
def test_a_new_default_process_group_gets_new_dmuon_groups(tmp_path) -> None:
    run_distributed(_cycles, 2, str(tmp_path))
