"""The runtime around a hook boundary: packs of dedicated parameters, the broadcast and reduce
collectives, the boundary groups and their hooks, and the ``DedicatedRuntime`` that holds it
all for one model."""

from ._collectives import GradListener
from ._config import BoundaryPredicate, DedicateConfig
from ._group import DedicatedGroup
from ._hooks import replicated_payload
from ._no_sync import no_sync
from ._runtime import RUNTIME_ATTR, DedicatedRuntime, check_conversions, get_runtime

__all__ = [
    "RUNTIME_ATTR",
    "BoundaryPredicate",
    "DedicateConfig",
    "DedicatedGroup",
    "DedicatedRuntime",
    "GradListener",
    "check_conversions",
    "get_runtime",
    "no_sync",
    "replicated_payload",
]
