"""Parameter holders: one object per parameter dmuon takes over, which owns its state on this
rank and its verbs (see [Note: parameter holders] in ``_holder``), the kinds of them and the
registry that picks a parameter's kind (``_kinds``), what a parameter's class says of its state
(the guard of a weight not held here, the wait for one being published), and the view of a
tensor dmuon does not take over (``_tensors``: a shard, or the whole tensor)."""

from ._dedicated import DedicatedParam, TensorParallelParam
from ._experts import ExpertStack, SourcedExpertStack
from ._guard import (
    DEEPCOPY_FIX,
    FULLY_SHARD_FIX,
    STEPS_DEDICATED,
    NotHeldError,
    check_guardable,
    compiled_autograd_error,
    is_dedicated,
    refuse_accelerate_clip,
    refuse_ddp,
    refuse_foreign_optimizers,
    refuse_module_load,
    refuse_module_state_dict,
    refuse_torch_clip,
    refuse_torch_state_dict,
    register_dmuon_optimizer,
)
from ._holder import (
    Found,
    HolderState,
    MuonEntry,
    ParamHolder,
    Role,
    StepContext,
    WeightPart,
)
from ._kinds import KINDS, KindRegistration, kind_of, register_kind
from ._precision import (
    Precision,
    fsdp_modules,
    fsdp_modules_above,
    mp_policy_above,
    resolve_precision,
)
from ._tensors import ShardedTensor, TensorView, WholeTensor, tensor_view
from ._tp_ns import TensorParallelNS, TPMode, gram_of
from ._tp_ns import choose as choose_tp_mode

__all__ = [
    "DEEPCOPY_FIX",
    "FULLY_SHARD_FIX",
    "KINDS",
    "STEPS_DEDICATED",
    "DedicatedParam",
    "ExpertStack",
    "Found",
    "HolderState",
    "KindRegistration",
    "MuonEntry",
    "NotHeldError",
    "ParamHolder",
    "Precision",
    "Role",
    "ShardedTensor",
    "SourcedExpertStack",
    "StepContext",
    "TPMode",
    "TensorParallelNS",
    "TensorParallelParam",
    "TensorView",
    "WeightPart",
    "WholeTensor",
    "check_guardable",
    "choose_tp_mode",
    "compiled_autograd_error",
    "fsdp_modules",
    "fsdp_modules_above",
    "gram_of",
    "is_dedicated",
    "kind_of",
    "mp_policy_above",
    "refuse_accelerate_clip",
    "refuse_ddp",
    "refuse_foreign_optimizers",
    "refuse_module_load",
    "refuse_module_state_dict",
    "refuse_torch_clip",
    "refuse_torch_state_dict",
    "register_dmuon_optimizer",
    "register_kind",
    "resolve_precision",
    "tensor_view",
]
