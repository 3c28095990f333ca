"""How a model gets its runtime: ``dedicate_params`` (FSDP2 and HSDP), the replicated (DDP)
path, and how a later ``fully_shard`` leaves dedicated parameters alone."""

from ._dedicate import (
    dedicate_params,
    dedicate_params_ddp,
    dedicate_params_ddp_tp,
    parameter_names,
)
from ._fsdp_integration import dedicated_params_of, install_patch, uninstall_patch
from ._replicate import replicate, replicate_tp

__all__ = [
    "dedicate_params",
    "dedicate_params_ddp",
    "dedicate_params_ddp_tp",
    "dedicated_params_of",
    "install_patch",
    "parameter_names",
    "replicate",
    "replicate_tp",
    "uninstall_patch",
]
