"""dmuon_fsdp: the dedicated-ownership runtime on FSDP2 (``dedicate_params`` and friends).

``dedicate_params_ddp_tp`` and ``replicate_tp`` are deprecated names of ``dedicate_params_ddp``
and ``replicate``: still importable for one release, outside ``__all__``, and each warns.
"""

from dmuon_ownership import MatrixSplit

from ._api import (
    broadcast_all_updates,
    broadcast_all_updates_async,
    get_comm_ctx,
    get_dedicated_params,
    get_owned_params,
    prepare_muon_grads,
    wait_all_reduces,
    wait_all_replicate_broadcasts,
)
from ._diagnostics import (
    BoundaryPlan,
    BoundaryUnshard,
    CommPlanSummary,
    ForwardUnshardProfile,
    Hyperparameters,
    Matrices,
    MatrixPiece,
    PackRow,
    ParamGroupSummary,
    ParamRow,
    collect_forward_unshard_profile,
    summarize_comm_plan,
    summarize_param_groups,
)
from ._ema import EMA
from ._matrix import LrScaling
from ._max_logits import max_logits, max_logits_from_lse, max_logits_from_scores
from .checkpoint import (
    CHECKPOINT_KEY,
    AppState,
    CheckpointIntegrityError,
    get_model_state_dict,
    get_optimizer_state_dict,
    init_dedicated_,
    load_checkpoint,
    save_checkpoint,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from .holder import DedicatedParam, NotHeldError, Role, WeightPart
from .optim import Muon, MuonClipGrads, MuonParts, MuonStepStats, QKClip, QKRowMap, StepOptions
from .runtime import DedicateConfig, DedicatedRuntime, get_runtime, no_sync
from .setup import (
    dedicate_params,
    dedicate_params_ddp,
    dedicated_params_of,
    install_patch,
    replicate,
    uninstall_patch,
)
from .setup import dedicate_params_ddp_tp as dedicate_params_ddp_tp
from .setup import replicate_tp as replicate_tp
from .topology import Axis, CommCounter, CommKind, DedicatedCommContext, ProcessGroupPolicy

__all__ = [
    "CHECKPOINT_KEY",
    "EMA",
    "AppState",
    "Axis",
    "BoundaryPlan",
    "BoundaryUnshard",
    "CheckpointIntegrityError",
    "CommCounter",
    "CommKind",
    "CommPlanSummary",
    "DedicateConfig",
    "DedicatedCommContext",
    "DedicatedParam",
    "DedicatedRuntime",
    "ForwardUnshardProfile",
    "Hyperparameters",
    "LrScaling",
    "Matrices",
    "MatrixPiece",
    "MatrixSplit",
    "Muon",
    "MuonClipGrads",
    "MuonParts",
    "MuonStepStats",
    "NotHeldError",
    "PackRow",
    "ParamGroupSummary",
    "ParamRow",
    "ProcessGroupPolicy",
    "QKClip",
    "QKRowMap",
    "Role",
    "StepOptions",
    "WeightPart",
    "broadcast_all_updates",
    "broadcast_all_updates_async",
    "collect_forward_unshard_profile",
    "dedicate_params",
    "dedicate_params_ddp",
    "dedicated_params_of",
    "get_comm_ctx",
    "get_dedicated_params",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_owned_params",
    "get_runtime",
    "init_dedicated_",
    "install_patch",
    "load_checkpoint",
    "max_logits",
    "max_logits_from_lse",
    "max_logits_from_scores",
    "no_sync",
    "prepare_muon_grads",
    "replicate",
    "save_checkpoint",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "summarize_comm_plan",
    "summarize_param_groups",
    "uninstall_patch",
    "wait_all_reduces",
    "wait_all_replicate_broadcasts",
]
