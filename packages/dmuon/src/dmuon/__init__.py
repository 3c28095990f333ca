"""dmuon: distributed Muon for PyTorch FSDP2 — the documented API, re-exported.

    import dmuon
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: "proj" in n and p.ndim == 2)
    dedicated = dmuon.dedicated_params_of(model)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=dedicated)
    fully_shard(model, mesh=mesh, ignored_params=dedicated)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)

Every name comes from one of the four packages (``dmuon_fsdp``: the runtime and optimizer,
``dmuon_ns``: Newton–Schulz, ``dmuon_clip``: clipping, ``dmuon_ownership``: the planner
before the run), imported as ``name as name`` (the explicit re-export type checkers read);
``__all__`` is exactly those names but the deprecated ones (``_DEPRECATED``). This module holds
no logic, and importing it does no work (no device queries, no compilation, no patching).
"""

from dmuon_clip import GradClipBucket as GradClipBucket
from dmuon_clip import GradClipBucketStats as GradClipBucketStats
from dmuon_clip import MuonGradClipStats as MuonGradClipStats
from dmuon_clip import SegmentedGradClipResult as SegmentedGradClipResult
from dmuon_clip import clip_grad_norm_ as clip_grad_norm_
from dmuon_clip import clip_grad_norm_buckets_ as clip_grad_norm_buckets_
from dmuon_clip import register_muon_grad_clip_strategy as register_muon_grad_clip_strategy
from dmuon_clip import (
    try_clip_optimizer_grad_norm_buckets_ as try_clip_optimizer_grad_norm_buckets_,
)
from dmuon_fsdp import CHECKPOINT_KEY as CHECKPOINT_KEY
from dmuon_fsdp import AppState as AppState
from dmuon_fsdp import CheckpointIntegrityError as CheckpointIntegrityError
from dmuon_fsdp import DedicateConfig as DedicateConfig
from dmuon_fsdp import DedicatedCommContext as DedicatedCommContext
from dmuon_fsdp import Muon as Muon
from dmuon_fsdp import NotHeldError as NotHeldError
from dmuon_fsdp import QKClip as QKClip
from dmuon_fsdp import QKRowMap as QKRowMap
from dmuon_fsdp import WeightPart as WeightPart
from dmuon_fsdp import broadcast_all_updates as broadcast_all_updates
from dmuon_fsdp import broadcast_all_updates_async as broadcast_all_updates_async
from dmuon_fsdp import collect_forward_unshard_profile as collect_forward_unshard_profile
from dmuon_fsdp import dedicate_params as dedicate_params
from dmuon_fsdp import dedicate_params_ddp as dedicate_params_ddp
from dmuon_fsdp import dedicate_params_ddp_tp as dedicate_params_ddp_tp
from dmuon_fsdp import dedicated_params_of as dedicated_params_of
from dmuon_fsdp import get_comm_ctx as get_comm_ctx
from dmuon_fsdp import get_dedicated_params as get_dedicated_params
from dmuon_fsdp import get_model_state_dict as get_model_state_dict
from dmuon_fsdp import get_optimizer_state_dict as get_optimizer_state_dict
from dmuon_fsdp import get_owned_params as get_owned_params
from dmuon_fsdp import init_dedicated_ as init_dedicated_
from dmuon_fsdp import install_patch as install_patch
from dmuon_fsdp import load_checkpoint as load_checkpoint
from dmuon_fsdp import max_logits as max_logits
from dmuon_fsdp import max_logits_from_lse as max_logits_from_lse
from dmuon_fsdp import max_logits_from_scores as max_logits_from_scores
from dmuon_fsdp import no_sync as no_sync
from dmuon_fsdp import prepare_muon_grads as prepare_muon_grads
from dmuon_fsdp import replicate as replicate
from dmuon_fsdp import replicate_tp as replicate_tp
from dmuon_fsdp import save_checkpoint as save_checkpoint
from dmuon_fsdp import set_model_state_dict as set_model_state_dict
from dmuon_fsdp import set_optimizer_state_dict as set_optimizer_state_dict
from dmuon_fsdp import summarize_comm_plan as summarize_comm_plan
from dmuon_fsdp import summarize_param_groups as summarize_param_groups
from dmuon_fsdp import uninstall_patch as uninstall_patch
from dmuon_fsdp import wait_all_reduces as wait_all_reduces
from dmuon_fsdp import wait_all_replicate_broadcasts as wait_all_replicate_broadcasts
from dmuon_ns import POLAR_EXPRESS_COEFFICIENTS as POLAR_EXPRESS_COEFFICIENTS
from dmuon_ns import YOU_COEFFICIENTS as YOU_COEFFICIENTS
from dmuon_ns import NewtonSchulz as NewtonSchulz
from dmuon_ns import direct_newton_schulz as direct_newton_schulz
from dmuon_ns import get_backend_status as get_backend_status
from dmuon_ns import get_ns_backend as get_ns_backend
from dmuon_ns import gram_newton_schulz as gram_newton_schulz
from dmuon_ns import newton_schulz as newton_schulz

from .plan import Forecast as Forecast
from .plan import ModelShapes as ModelShapes
from .plan import Topology as Topology
from .plan import forecast as forecast
from .plan import model_shapes as model_shapes

__version__ = "0.1.0"

# Deprecated names of dedicate_params_ddp and replicate: importable for one release, outside
# __all__; each warns and names its replacement.
_DEPRECATED = frozenset({"dedicate_params_ddp_tp", "replicate_tp"})

# Every public name above: the re-exports, listed once (in their imports). ``plan`` is the
# sub-package the planner's names come from, not a name of its own.
__all__ = sorted(
    n for n in dict(globals()) if not n.startswith("_") and n not in _DEPRECATED | {"plan"}
)
