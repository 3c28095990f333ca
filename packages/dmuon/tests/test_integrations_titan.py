"""The torchtitan recipe (``docs/examples/integrations/torchtitan_train.py``, torchtitan 0.3.0)
on CUDA, one rank in a process group of this process (NCCL): the example's own run, the
two-block debug model through ``parallelize_llama_dmuon``, ``DmuonOptimizersContainer`` and
``DmuonCheckpointManager`` for 10 steps with a checkpoint at step 5, then again from other
initial weights resumed from step 5. The checks are the example's: the loss falls, and the
resumed steps' losses equal the uninterrupted run's bit for bit.

[Note: torchtitan 0.3.0 on torch 2.11]
torchtitan 0.3.0 imports ``torch.distributed.fsdp.DataParallelMeshDims`` when
``torchtitan.distributed.fsdp`` is imported; torch has it from 2.12 on. torchtitan builds it
only for its ``spmd_types`` and ``full_dtensor`` SPMD backends, and the recipe runs
``partial_dtensor`` (``parallelize_llama_dmuon`` refuses the other two), so on an older torch
the test puts a class of that name in its place that raises if it is ever built: the import
succeeds, and a path that would need the real one fails the test instead of running.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

EXAMPLE = Path(__file__).resolve().parents[3] / "docs/examples/integrations/torchtitan_train.py"


class DataParallelMeshDimsOfNewerTorch:
    """Stands for ``torch.distributed.fsdp.DataParallelMeshDims`` where torch lacks it (see
    [Note: torchtitan 0.3.0 on torch 2.11])."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "torchtitan built DataParallelMeshDims, which this torch lacks (torch >= 2.12 has"
            " it): the recipe took a path other than the partial_dtensor backend's"
        )


def _example(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        monkeypatch.setattr(
            fsdp, "DataParallelMeshDims", DataParallelMeshDimsOfNewerTorch, raising=False
        )
    pytest.importorskip("torchtitan")
    spec = importlib.util.spec_from_file_location("torchtitan_train", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module


def train_and_resume(example: ModuleType, directory: str, device: torch.device):
    """The example's two runs on this process group: uninterrupted, then resumed."""
    uninterrupted = example.run(example.small_config(directory, resume_from=None), 0, device)
    resumed = example.run(example.small_config(directory, resume_from=example.SAVE_AT), 1, device)
    return uninterrupted, resumed


def test_torchtitan_recipe_trains_and_resumes_bit_for_bit_on_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    example = _example(monkeypatch)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1, device_id=device
    )
    try:
        uninterrupted, resumed = train_and_resume(example, str(tmp_path / "run"), device)
    finally:
        dist.destroy_process_group()
    losses = [uninterrupted[step] for step in sorted(uninterrupted)]
    assert sorted(uninterrupted) == list(range(1, example.STEPS + 1)), uninterrupted
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] / 2, losses
    assert resumed == {s: x for s, x in uninterrupted.items() if s > example.SAVE_AT}
