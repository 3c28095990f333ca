"""dmuon_ownership: pure planning for dedicated-owner optimizers.

Describe parameters as :class:`WorkItem`, get a frozen :class:`Plan` from :func:`plan_owners`
(identical on every rank for identical inputs; compare :meth:`Plan.fingerprint`), and resolve
each parameter's route and dtypes with :func:`resolve_param_policy`. Standard library only.
The forecast before a run (``dmuon.plan``, ``dmuon-plan``) makes its plans with the same
:func:`plan_owners`.
"""

from ._cost import (
    CostFn,
    ExpertStack,
    elementwise_cost,
    expert_base_loads,
    experts_held,
    ns_cost,
    ns_flops,
    tp_gram_pays,
)
from ._expert_sources import ExpertSource
from ._items import Owner, WorkItem
from ._lpt import plan_owners
from ._plan import Plan, Unit, UnknownParamError, validate_plan
from ._policy import (
    POLICY_FIELDS,
    ParamPolicy,
    ResolvedPolicy,
    resolve_param_policy,
    validate_param_policy,
)
from ._route import Route, normalize_dtype
from ._split import MatrixSplit, RowBlock

__all__ = [
    "POLICY_FIELDS",
    "CostFn",
    "ExpertSource",
    "ExpertStack",
    "MatrixSplit",
    "Owner",
    "ParamPolicy",
    "Plan",
    "ResolvedPolicy",
    "Route",
    "RowBlock",
    "Unit",
    "UnknownParamError",
    "WorkItem",
    "elementwise_cost",
    "expert_base_loads",
    "experts_held",
    "normalize_dtype",
    "ns_cost",
    "ns_flops",
    "plan_owners",
    "resolve_param_policy",
    "tp_gram_pays",
    "validate_param_policy",
    "validate_plan",
]
