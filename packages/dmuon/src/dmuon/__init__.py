"""dmuon: distributed Muon for PyTorch FSDP2 — the documented API, re-exported.

    import dmuon
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: "proj" in n and p.ndim == 2)
    dedicated = dmuon.dedicated_params_of(model)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=dedicated)
    fully_shard(model, mesh=mesh, ignored_params=dedicated)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)

Every name comes from one of the four packages (``dmuon_fsdp``: the runtime and optimizer,
``dmuon_ns``: Newton–Schulz, ``dmuon_clip``: clipping); this module holds no logic, and
importing it does no work (no device queries, no compilation, no patching).
"""

from dmuon_clip import (
    GradClipBucket,
    GradClipBucketStats,
    MuonGradClipStats,
    SegmentedGradClipResult,
    clip_grad_norm_,
    clip_grad_norm_buckets_,
    register_muon_grad_clip_strategy,
    try_clip_optimizer_grad_norm_buckets_,
)
from dmuon_fsdp import (
    CHECKPOINT_KEY,
    AppState,
    DedicatedCommContext,
    Muon,
    NotHeldError,
    broadcast_all_updates,
    broadcast_all_updates_async,
    collect_forward_unshard_profile,
    dedicate_params,
    dedicate_params_ddp,
    dedicated_params_of,
    get_comm_ctx,
    get_dedicated_params,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_owned_params,
    install_patch,
    load_checkpoint,
    no_sync,
    prepare_muon_grads,
    replicate,
    save_checkpoint,
    set_model_state_dict,
    set_optimizer_state_dict,
    summarize_comm_plan,
    summarize_param_groups,
    uninstall_patch,
    wait_all_reduces,
    wait_all_replicate_broadcasts,
)
from dmuon_ns import (
    POLAR_EXPRESS_COEFFICIENTS,
    YOU_COEFFICIENTS,
    NewtonSchulz,
    direct_newton_schulz,
    get_backend_status,
    get_ns_backend,
    gram_newton_schulz,
    newton_schulz,
)

__version__ = "0.1.0"

__all__ = [
    "CHECKPOINT_KEY",
    "POLAR_EXPRESS_COEFFICIENTS",
    "YOU_COEFFICIENTS",
    "AppState",
    "DedicatedCommContext",
    "GradClipBucket",
    "GradClipBucketStats",
    "Muon",
    "MuonGradClipStats",
    "NewtonSchulz",
    "NotHeldError",
    "SegmentedGradClipResult",
    "broadcast_all_updates",
    "broadcast_all_updates_async",
    "clip_grad_norm_",
    "clip_grad_norm_buckets_",
    "collect_forward_unshard_profile",
    "dedicate_params",
    "dedicate_params_ddp",
    "dedicated_params_of",
    "direct_newton_schulz",
    "get_backend_status",
    "get_comm_ctx",
    "get_dedicated_params",
    "get_model_state_dict",
    "get_ns_backend",
    "get_optimizer_state_dict",
    "get_owned_params",
    "gram_newton_schulz",
    "install_patch",
    "load_checkpoint",
    "newton_schulz",
    "no_sync",
    "prepare_muon_grads",
    "register_muon_grad_clip_strategy",
    "replicate",
    "save_checkpoint",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "summarize_comm_plan",
    "summarize_param_groups",
    "try_clip_optimizer_grad_norm_buckets_",
    "uninstall_patch",
    "wait_all_reduces",
    "wait_all_replicate_broadcasts",
]
