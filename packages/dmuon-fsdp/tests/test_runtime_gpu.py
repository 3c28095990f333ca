"""The runtime on CUDA with NCCL (GPU machine): dedicated comm streams and events instead of
gloo work handles. Same checks as the CPU tests: single-process reference, Z2 == Z3 bit for
bit, bytes per step, and with four GPUs HSDP 2×2 (async == sync, close to 1-D)."""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = 4


def _worker(rank: int, world_size: int, init_file: str) -> None:
    from _models import build, muon_numel, reduce_numel
    from _sgd_train import merge_owned, reference_sgd, sgd_run

    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group(
        "nccl",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),
        device_id=torch.device("cuda", rank),
    )
    try:
        runs = {
            "z2": sgd_run(rank, world_size, steps=STEPS, reshard=False, device="cuda"),
            "z3": sgd_run(rank, world_size, steps=STEPS, reshard=True, device="cuda"),
        }
        if world_size % 2 == 0 and world_size >= 4:
            for key, async_ in (("hsdp_async", True), ("hsdp_sync", False)):
                runs[key] = sgd_run(
                    rank, world_size, steps=STEPS, replicate=2, async_=async_, device="cuda"
                )
        gathered: list[object] = [None] * world_size
        dist.all_gather_object(gathered, runs)
        if rank != 0:
            return
        per_key = {key: [g[key] for g in gathered] for key in runs}  # type: ignore[index]
        weights = {key: merge_owned(results) for key, results in per_key.items()}
        ref_losses, ref_weights = reference_sgd(STEPS, device="cuda")
        assert per_key["z2"][0].losses == per_key["z3"][0].losses
        for name, value in weights["z3"].items():
            assert torch.equal(weights["z2"][name], value), name
            torch.testing.assert_close(value, ref_weights[name], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(
            torch.tensor(per_key["z3"][0].losses), torch.tensor(ref_losses), rtol=1e-4, atol=0
        )
        p_m = muon_numel(build(0)) * 4 if world_size > 1 else 0  # one rank sends nothing
        # A reduce also carries a presence flag per matrix.
        reduced = reduce_numel(build(0)) * 4 if world_size > 1 else 0
        for key, rounds in (("z2", 1), ("z3", 2)):
            for result in per_key[key]:
                for step_bytes in result.bytes_per_step:
                    assert step_bytes["shard/broadcast"] == rounds * p_m
                    assert step_bytes["shard/reduce"] == reduced
        if "hsdp_async" in per_key:
            assert per_key["hsdp_async"][0].losses == per_key["hsdp_sync"][0].losses
            for name, value in weights["hsdp_async"].items():
                assert torch.equal(weights["hsdp_sync"][name], value), name
                torch.testing.assert_close(value, weights["z3"][name], rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_runtime_on_nccl() -> None:
    # One GPU still runs the CUDA code paths (streams, events, the FSDP2 integration on this
    # torch); collectives need two or more, HSDP four.
    world_size = min(torch.cuda.device_count(), 4)
    if world_size < 1:
        pytest.skip("needs a CUDA device")
    tests_dir = os.path.dirname(__file__)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [
            tests_dir,
            os.path.join(tests_dir, "..", "..", "..", "testing"),
            *os.environ.get("PYTHONPATH", "").split(os.pathsep),
        ]
    )
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world_size, os.path.join(tmp, "init")), nprocs=world_size)
