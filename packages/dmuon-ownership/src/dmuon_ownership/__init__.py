"""dmuon_ownership: pure planning for dedicated-owner optimizers.

Describe parameters as :class:`WorkItem`, get a frozen :class:`Plan` from :func:`plan_owners`
(identical on every rank for identical inputs; compare :meth:`Plan.fingerprint`), and resolve
each parameter's route and dtypes with :func:`resolve_param_policy`. Before a run,
:func:`forecast` turns a Hugging Face config and a :class:`Topology` into per-rank figures
(memory, bytes per step, optimizer work, predicted NS time); ``dmuon-plan`` prints them.
Standard library only.
"""

from ._cost import (
    CostFn,
    ExpertStack,
    elementwise_cost,
    expert_base_loads,
    experts_held,
    ns_cost,
    ns_flops,
)
from ._expert_sources import ExpertSource
from ._forecast import Forecast, RankFigures, Spread, Topology, forecast
from ._items import Owner, WorkItem
from ._lpt import plan_owners
from ._model_shapes import ModelShapes, model_shapes
from ._ns_times import NSTimes, load_ns_times
from ._plan import Plan, Unit, UnknownParamError, validate_plan
from ._policy import (
    POLICY_FIELDS,
    ParamPolicy,
    ResolvedPolicy,
    resolve_param_policy,
    validate_param_policy,
)
from ._route import Route

__all__ = [
    "POLICY_FIELDS",
    "CostFn",
    "ExpertSource",
    "ExpertStack",
    "Forecast",
    "ModelShapes",
    "NSTimes",
    "Owner",
    "ParamPolicy",
    "Plan",
    "RankFigures",
    "ResolvedPolicy",
    "Route",
    "Spread",
    "Topology",
    "Unit",
    "UnknownParamError",
    "WorkItem",
    "elementwise_cost",
    "expert_base_loads",
    "experts_held",
    "forecast",
    "load_ns_times",
    "model_shapes",
    "ns_cost",
    "ns_flops",
    "plan_owners",
    "resolve_param_policy",
    "validate_param_policy",
    "validate_plan",
]
