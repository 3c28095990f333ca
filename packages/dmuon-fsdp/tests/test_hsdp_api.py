"""The HSDP entry points: grid coordinates in ``get_owned_params``, and publishing an owner's
changed weight with ``broadcast_all_updates`` (sync) or ``broadcast_all_updates_async`` +
``wait_all_replicate_broadcasts``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _models import build, muon_predicate
from torch.distributed.device_mesh import init_device_mesh

from dmuon_fsdp import (
    Role,
    broadcast_all_updates,
    broadcast_all_updates_async,
    dedicate_params,
    get_dedicated_params,
    get_owned_params,
    get_runtime,
    wait_all_replicate_broadcasts,
)
from dmuon_testing.distributed import run_distributed


def _api(rank: int, world_size: int) -> None:
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = build(0)
    runtime = dedicate_params(
        model,
        hsdp["shard"],
        muon_predicate,
        replicate_mesh=hsdp["replicate"],
        small_param_threshold=0,
    )
    assert runtime.coord == (hsdp["shard"].get_local_rank(), hsdp["replicate"].get_local_rank())
    everything = get_dedicated_params(model)
    by_coord = [get_owned_params(model, (s, r)) for r in range(2) for s in range(2)]
    assert sorted(dp.fqn for owned in by_coord for dp in owned) == sorted(
        dp.fqn for dp in everything
    )
    assert all(owned for owned in by_coord)  # 14 matrices placed alone: every slot has work
    assert [dp.fqn for dp in get_owned_params(model, rank)] == [dp.fqn for dp in runtime.owned]
    for dp in everything:
        column = dp.owner.shard == runtime.coord.shard
        assert dp.role is (
            Role.OWNER if dp.owner == runtime.coord else Role.REPLICA if column else Role.PEER
        )
        # Column presence: every rank of the owner's shard column holds the weight.
        assert (dp.param.untyped_storage().size() > 0) == column

    for step, publish in enumerate(("sync", "async")):
        for dp in runtime.owned:
            assert dp.full is not None
            dp.full.fill_(float(10 * step + runtime.global_rank(dp.owner) + 1))
        if publish == "sync":
            broadcast_all_updates(model)
        else:
            broadcast_all_updates_async(model)
            wait_all_replicate_broadcasts(model)
        for dp in everything:
            if dp.role is Role.REPLICA:
                expected = float(10 * step + get_runtime(model).global_rank(dp.owner) + 1)
                assert torch.all(dp.param.detach() == expected), (publish, dp.fqn)
    dist.barrier()


@pytest.mark.distributed
def test_hsdp_owned_params_and_publish() -> None:
    run_distributed(_api, 4)
