"""The meta package re-exports the documented API and does no work at import."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import dmuon

SUBPACKAGES = ("dmuon_fsdp", "dmuon_ns", "dmuon_clip", "dmuon_ownership")

# Every public name documented for users of ``import dmuon`` (docs/api and the README).
DOCUMENTED_NAMES = frozenset(
    {
        # setup
        "dedicate_params",
        "DedicateConfig",
        "dedicated_params_of",
        "install_patch",
        "uninstall_patch",
        "dedicate_params_ddp",
        "replicate",
        # optimizer
        "Muon",
        "WeightPart",
        # QK-clip
        "QKClip",
        "QKRowMap",
        "max_logits",
        "max_logits_from_lse",
        "max_logits_from_scores",
        # reads of a dedicated weight where it is not held
        "NotHeldError",
        # Newton–Schulz
        "NewtonSchulz",
        "newton_schulz",
        "gram_newton_schulz",
        "direct_newton_schulz",
        "POLAR_EXPRESS_COEFFICIENTS",
        "YOU_COEFFICIENTS",
        "get_ns_backend",
        "get_backend_status",
        # state
        "no_sync",
        "prepare_muon_grads",
        "wait_all_reduces",
        "broadcast_all_updates",
        "broadcast_all_updates_async",
        "wait_all_replicate_broadcasts",
        "get_dedicated_params",
        "get_owned_params",
        "get_comm_ctx",
        "DedicatedCommContext",
        # clipping
        "clip_grad_norm_",
        "register_muon_grad_clip_strategy",
        "MuonGradClipStats",
        "clip_grad_norm_buckets_",
        "try_clip_optimizer_grad_norm_buckets_",
        "GradClipBucket",
        "GradClipBucketStats",
        "SegmentedGradClipResult",
        # diagnostics
        "summarize_param_groups",
        "summarize_comm_plan",
        "collect_forward_unshard_profile",
        # checkpoint
        "get_model_state_dict",
        "set_model_state_dict",
        "init_dedicated_",
        "get_optimizer_state_dict",
        "set_optimizer_state_dict",
        "AppState",
        "save_checkpoint",
        "load_checkpoint",
        "CHECKPOINT_KEY",
        "CheckpointIntegrityError",
        # the planner before the run (dmuon-plan)
        "forecast",
        "Forecast",
        "Topology",
        "model_shapes",
        "ModelShapes",
    }
)


def _providers() -> dict[str, object]:
    """Documented name -> the object a sub-package exports under it (first provider wins)."""
    found: dict[str, object] = {}
    for package in SUBPACKAGES:
        module = importlib.import_module(package)
        for name in getattr(module, "__all__", ()):
            if name in DOCUMENTED_NAMES and name not in found:
                found[name] = getattr(module, name)
    return found


def test_every_provided_documented_name_is_reexported() -> None:
    provided = _providers()
    assert provided, "no sub-package provides any documented name: the check would be vacuous"
    missing = sorted(set(provided) - set(dmuon.__all__))
    assert not missing, f"dmuon does not re-export {missing}"
    for name, obj in provided.items():
        assert getattr(dmuon, name) is obj, f"dmuon.{name} is not the sub-package's object"


def test_all_is_exactly_the_provided_documented_names() -> None:
    assert len(dmuon.__all__) == len(set(dmuon.__all__)), "duplicates in dmuon.__all__"
    assert set(dmuon.__all__) == set(_providers())
    for name in dmuon.__all__:
        assert hasattr(dmuon, name)


def test_deprecated_names_stay_importable_outside_all() -> None:
    import dmuon_fsdp

    for name in ("dedicate_params_ddp_tp", "replicate_tp"):
        assert name not in dmuon.__all__ and name not in dmuon_fsdp.__all__
        assert getattr(dmuon, name) is getattr(dmuon_fsdp, name)


def test_the_core_workflow_names_exist() -> None:
    # The four steps of the user guide must work from the meta package alone.
    for name in ("dedicate_params", "Muon", "no_sync", "get_model_state_dict"):
        assert name in dmuon.__all__


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
