"""dmuon_fsdp: the dedicated-ownership runtime on FSDP2 (``dedicate_params`` and friends)."""

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
from ._checkpoint import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from ._collectives import Axis, CommCounter, CommKind
from ._comm import DedicatedCommContext, ProcessGroupPolicy
from ._dedicate import dedicate_params
from ._diagnostics import (
    collect_forward_unshard_profile,
    summarize_comm_plan,
    summarize_param_groups,
)
from ._fsdp_integration import install_patch
from ._muon_math import LrScaling
from ._no_sync import no_sync
from ._optimizer import Muon, MuonClipGrads
from ._param import DedicatedParam, Role
from ._runtime import DedicateConfig, DedicatedRuntime, get_runtime

__all__ = [
    "Axis",
    "CommCounter",
    "CommKind",
    "DedicateConfig",
    "DedicatedCommContext",
    "DedicatedParam",
    "DedicatedRuntime",
    "LrScaling",
    "Muon",
    "MuonClipGrads",
    "ProcessGroupPolicy",
    "Role",
    "broadcast_all_updates",
    "broadcast_all_updates_async",
    "collect_forward_unshard_profile",
    "dedicate_params",
    "get_comm_ctx",
    "get_dedicated_params",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_owned_params",
    "get_runtime",
    "install_patch",
    "no_sync",
    "prepare_muon_grads",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "summarize_comm_plan",
    "summarize_param_groups",
    "wait_all_reduces",
    "wait_all_replicate_broadcasts",
]
