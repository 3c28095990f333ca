"""dmuon: distributed Muon for PyTorch FSDP2 — the documented API, re-exported.

    import dmuon
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: "proj" in n and p.ndim == 2)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)  # skips the dedicated matrices (dedicate_params' patch)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)

The top level holds what a training script uses (one page: ``__all__``); the rest lives in
public sub-modules by topic: :mod:`dmuon.ns` (Newton–Schulz kernels and coefficients),
:mod:`dmuon.clip` (clipping strategies and bucketed clipping), :mod:`dmuon.qk_clip`
(QK-clip row maps and the max-logit helpers), :mod:`dmuon.runtime` (explicit synchronisation,
inspection, the comm context), :mod:`dmuon.plan` (the forecast before a run, pure Python), each
reachable after ``import dmuon``. Every top-level name comes from one of the four packages (``dmuon_fsdp``,
``dmuon_ns``, ``dmuon_clip``, ``dmuon_ownership``), imported as ``name as name`` (the explicit
re-export type checkers read). Names that used to live at the top level still resolve there
for one release, with a ``DeprecationWarning`` naming their new place. This module holds no
logic, and importing it does no work (no device queries, no compilation, no patching).
"""

from types import ModuleType as _Module
from typing import Any as _Any

from dmuon_clip import clip_grad_norm_ as clip_grad_norm_
from dmuon_fsdp import EMA as EMA
from dmuon_fsdp import AppState as AppState
from dmuon_fsdp import CheckpointIntegrityError as CheckpointIntegrityError
from dmuon_fsdp import DedicateConfig as DedicateConfig
from dmuon_fsdp import MatrixSplit as MatrixSplit
from dmuon_fsdp import Muon as Muon
from dmuon_fsdp import MuonParts as MuonParts
from dmuon_fsdp import NotHeldError as NotHeldError
from dmuon_fsdp import QKClip as QKClip
from dmuon_fsdp import StepOptions as StepOptions
from dmuon_fsdp import WeightPart as WeightPart
from dmuon_fsdp import dedicate_params as dedicate_params
from dmuon_fsdp import dedicate_params_ddp as dedicate_params_ddp
from dmuon_fsdp import dedicated_params_of as dedicated_params_of
from dmuon_fsdp import get_model_state_dict as get_model_state_dict
from dmuon_fsdp import get_optimizer_state_dict as get_optimizer_state_dict
from dmuon_fsdp import init_dedicated_ as init_dedicated_
from dmuon_fsdp import load_checkpoint as load_checkpoint
from dmuon_fsdp import max_logits as max_logits
from dmuon_fsdp import no_sync as no_sync
from dmuon_fsdp import replicate as replicate
from dmuon_fsdp import save_checkpoint as save_checkpoint
from dmuon_fsdp import set_model_state_dict as set_model_state_dict
from dmuon_fsdp import set_optimizer_state_dict as set_optimizer_state_dict
from dmuon_fsdp import summarize_comm_plan as summarize_comm_plan
from dmuon_fsdp import summarize_param_groups as summarize_param_groups
from dmuon_fsdp import uninstall_patch as uninstall_patch
from dmuon_ns import NewtonSchulz as NewtonSchulz
from dmuon_ns import get_ns_backend as get_ns_backend
from dmuon_ns import newton_schulz as newton_schulz

__version__ = "0.1.0"

# Every public name above, listed once (in their imports).
__all__ = sorted(
    n for n, v in dict(globals()).items() if not n.startswith("_") and not isinstance(v, _Module)
)

# The topic sub-modules, reachable as dmuon.<module> after ``import dmuon`` (re-exports, and
# dmuon.plan's pure-Python forecast: importing them does no work either).
from . import clip as clip
from . import ns as ns
from . import plan as plan
from . import qk_clip as qk_clip
from . import runtime as runtime

# The topic modules that hold the former top-level names (see ``__getattr__``).
_TOPICS = ("ns", "clip", "qk_clip", "runtime", "plan")
# Names of earlier releases kept for one more, each with its replacement.
_RENAMED = {
    "dedicate_params_ddp_tp": "dmuon.dedicate_params_ddp",
    "replicate_tp": "dmuon.replicate",
}


def __getattr__(name: str) -> _Any:
    """A former top-level name: warn, naming its new place, and return it."""
    import importlib
    import warnings

    for topic in _TOPICS:
        module = importlib.import_module(f"{__name__}.{topic}")
        if name in module.__all__:
            warnings.warn(
                f"dmuon.{name} moved to dmuon.{topic}.{name}; the top-level name goes away in "
                "the next release",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(module, name)
    if name in _RENAMED:
        import dmuon_fsdp

        return getattr(dmuon_fsdp, name)  # warns itself when called, naming the replacement
    raise AttributeError(f"module 'dmuon' has no attribute {name!r}")
