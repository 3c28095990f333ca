"""The runtime, for code that drives or inspects it beyond a training loop: explicit
synchronisation, who owns what, the comm context and its streams, the forward profile, the
``fully_shard`` patch, and the types of the dicts the diagnostics return
(``summarize_param_groups``, ``summarize_comm_plan``, ``collect_forward_unshard_profile``),
re-exported from ``dmuon_fsdp``.

    from dmuon.runtime import wait_all_reduces, get_owned_params
"""

from dmuon_fsdp import CHECKPOINT_KEY as CHECKPOINT_KEY
from dmuon_fsdp import BoundaryPlan as BoundaryPlan
from dmuon_fsdp import BoundaryUnshard as BoundaryUnshard
from dmuon_fsdp import CommPlanSummary as CommPlanSummary
from dmuon_fsdp import DedicatedCommContext as DedicatedCommContext
from dmuon_fsdp import ForwardUnshardProfile as ForwardUnshardProfile
from dmuon_fsdp import Hyperparameters as Hyperparameters
from dmuon_fsdp import Matrices as Matrices
from dmuon_fsdp import MatrixPiece as MatrixPiece
from dmuon_fsdp import PackRow as PackRow
from dmuon_fsdp import ParamGroupSummary as ParamGroupSummary
from dmuon_fsdp import ParamRow as ParamRow
from dmuon_fsdp import broadcast_all_updates as broadcast_all_updates
from dmuon_fsdp import broadcast_all_updates_async as broadcast_all_updates_async
from dmuon_fsdp import collect_forward_unshard_profile as collect_forward_unshard_profile
from dmuon_fsdp import get_comm_ctx as get_comm_ctx
from dmuon_fsdp import get_dedicated_params as get_dedicated_params
from dmuon_fsdp import get_owned_params as get_owned_params
from dmuon_fsdp import install_patch as install_patch
from dmuon_fsdp import prepare_muon_grads as prepare_muon_grads
from dmuon_fsdp import uninstall_patch as uninstall_patch
from dmuon_fsdp import wait_all_reduces as wait_all_reduces
from dmuon_fsdp import wait_all_replicate_broadcasts as wait_all_replicate_broadcasts

__all__ = sorted(n for n in dict(globals()) if not n.startswith("_"))
