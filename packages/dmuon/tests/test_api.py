"""The meta package re-exports the documented API and does no work at import."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest

import dmuon

SUBPACKAGES = ("dmuon_fsdp", "dmuon_ns", "dmuon_clip", "dmuon_ownership", "dmuon.plan")

# What a training script uses, at the top level: one page.
TOP_LEVEL = frozenset(
    {
        # setup
        "dedicate_params",
        "dedicate_params_ddp",
        "replicate",
        "dedicated_params_of",
        "uninstall_patch",
        "DedicateConfig",
        # optimizer and what acts inside its step
        "Muon",
        "MuonParts",
        "StepOptions",
        "WeightPart",
        "EMA",
        "QKClip",
        "max_logits",
        # training
        "no_sync",
        "clip_grad_norm_",
        # checkpoints and weights
        "save_checkpoint",
        "load_checkpoint",
        "AppState",
        "get_model_state_dict",
        "set_model_state_dict",
        "get_optimizer_state_dict",
        "set_optimizer_state_dict",
        "init_dedicated_",
        "CheckpointIntegrityError",
        "NotHeldError",
        # Newton–Schulz
        "newton_schulz",
        "NewtonSchulz",
        "get_ns_backend",
        # diagnostics and planning
        "summarize_param_groups",
        "summarize_comm_plan",
        "MatrixSplit",
    }
)

# The topic sub-modules and what each holds beyond the top level.
SUBMODULES = {
    "ns": {
        "POLAR_EXPRESS_COEFFICIENTS",
        "QUINTIC_COEFFICIENTS",
        "YOU_COEFFICIENTS",
        "NewtonSchulz",
        "newton_schulz",
        "gram_newton_schulz",
        "direct_newton_schulz",
        "get_ns_backend",
        "get_backend_status",
        "BackendStatus",
        "KernelAvailability",
        "NSKernel",
        "register_kernel",
        "tune_pending",
    },
    "clip": {
        "clip_grad_norm_",
        "clip_grad_value_",
        "clip_grads_with_norm_",
        "register_muon_grad_clip_strategy",
        "MuonGradClipStats",
        "clip_grad_norm_buckets_",
        "try_clip_optimizer_grad_norm_buckets_",
        "GradClipBucket",
        "GradClipBucketStats",
        "SegmentedGradClipResult",
    },
    "qk_clip": {
        "QKClip",
        "QKRowMap",
        "max_logits",
        "max_logits_from_lse",
        "max_logits_from_scores",
    },
    "plan": {
        "Fit",
        "Forecast",
        "GPU",
        "GPUS",
        "Link",
        "Links",
        "ModelShapes",
        "NSTimes",
        "RankFigures",
        "Spread",
        "Topology",
        "forecast",
        "load_ns_times",
        "model_shapes",
    },
    "runtime": {
        "CHECKPOINT_KEY",
        # the types of the diagnostics' dicts
        "ParamGroupSummary",
        "Hyperparameters",
        "ParamRow",
        "Matrices",
        "MatrixPiece",
        "CommPlanSummary",
        "BoundaryPlan",
        "PackRow",
        "ForwardUnshardProfile",
        "BoundaryUnshard",
        "DedicatedCommContext",
        "broadcast_all_updates",
        "broadcast_all_updates_async",
        "collect_forward_unshard_profile",
        "get_comm_ctx",
        "get_dedicated_params",
        "get_owned_params",
        "install_patch",
        "prepare_muon_grads",
        "uninstall_patch",
        "wait_all_reduces",
        "wait_all_replicate_broadcasts",
    },
}


def _provider(name: str) -> object:
    """The object the first provider exporting ``name`` gives."""
    for package in SUBPACKAGES:
        module = importlib.import_module(package)
        if name in getattr(module, "__all__", ()):
            return getattr(module, name)
    raise AssertionError(f"no sub-package exports {name!r}")


def test_the_top_level_fits_on_a_page_and_is_the_sub_packages_objects() -> None:
    # 31: MuonParts, the optimizer of a rank's several pipeline model parts.
    assert len(dmuon.__all__) == len(set(dmuon.__all__)) <= 31
    assert set(dmuon.__all__) == TOP_LEVEL
    for name in dmuon.__all__:
        assert getattr(dmuon, name) is _provider(name), f"dmuon.{name}"


def test_each_topic_module_reexports_its_names() -> None:
    for module_name, names in SUBMODULES.items():
        module = importlib.import_module(f"dmuon.{module_name}")
        assert getattr(dmuon, module_name) is module, f"import dmuon reaches dmuon.{module_name}"
        assert set(module.__all__) == names, module_name
        for name in names:
            assert getattr(module, name) is _provider(name), f"dmuon.{module_name}.{name}"


def test_former_top_level_names_warn_and_name_their_new_place() -> None:
    moved = {name: module for module, names in SUBMODULES.items() for name in names}
    for name, module in moved.items():
        if name in TOP_LEVEL:
            continue
        assert name not in dmuon.__all__
        with pytest.warns(DeprecationWarning, match=rf"dmuon\.{name} moved to dmuon\.{module}"):
            value = getattr(dmuon, name)
        assert value is getattr(importlib.import_module(f"dmuon.{module}"), name)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        dmuon.no_such_name  # noqa: B018


def test_deprecated_names_stay_importable_outside_all() -> None:
    import dmuon_fsdp

    for name in ("dedicate_params_ddp_tp", "replicate_tp"):
        assert name not in dmuon.__all__ and name not in dmuon_fsdp.__all__
        assert getattr(dmuon, name) is getattr(dmuon_fsdp, name)


def test_the_core_workflow_names_exist() -> None:
    # The four steps of the user guide must work from the meta package alone.
    for name in ("dedicate_params", "Muon", "no_sync", "get_model_state_dict"):
        assert name in dmuon.__all__


def test_muon_step_has_torch_optimizers_overloads() -> None:
    # As torch.optim.Optimizer.step: None without a closure, the closure's float with one. A
    # single ``-> float | None`` made ``loss: float = optimizer.step(closure)`` a type error.
    import typing

    overloads = typing.get_overloads(dmuon.Muon.step)
    assert [typing.get_type_hints(f)["return"] for f in overloads] == [type(None), float]


_NO_WORK = textwrap.dedent(
    """
    import sys
    import torch

    def refuse(*args, **kwargs):
        raise AssertionError("import dmuon queried the CUDA device")

    for name in ("is_available", "device_count", "init", "current_device",
                 "get_device_capability", "get_device_properties", "set_device"):
        setattr(torch.cuda, name, refuse)

    from torch.distributed.fsdp._fully_shard import _fsdp_init
    before = {n: getattr(_fsdp_init, n) for n in dir(_fsdp_init) if callable(getattr(_fsdp_init, n))}

    import dmuon  # noqa: F401

    assert "triton" not in sys.modules, "import dmuon imported triton"
    assert "transformers" not in sys.modules, "import dmuon imported transformers"
    assert "dmuon.integrations" not in sys.modules, "import dmuon imported its integrations"
    # dmuon's untraced functions (Muon's step, the clips) must not import the compiler here.
    assert "torch._dynamo" not in sys.modules, "import dmuon imported the compiler (torch._dynamo)"
    assert not torch.cuda.is_initialized(), "import dmuon initialised CUDA"
    changed = [n for n, f in before.items() if getattr(_fsdp_init, n) is not f]
    assert not changed, f"import dmuon patched FSDP2: {changed}"
    print("ok")
    """
)


def test_import_does_no_work() -> None:
    """In a fresh interpreter: no triton or transformers import, no CUDA query or init, no FSDP2
    patching."""
    done = subprocess.run(
        [sys.executable, "-c", _NO_WORK], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
