"""dmuon.plan: what dmuon will hold per rank, move per step and compute, before the run.

:func:`forecast` turns a Hugging Face ``config.json`` (:func:`model_shapes` writes out its
parameters, without building the model) and a :class:`Topology` into a :class:`Forecast`:
per-rank figures (:class:`Spread` over the ranks, every rank's exact :class:`RankFigures`) of
memory, bytes per step, optimizer work and the Newton–Schulz time predicted from measured NS
times (:class:`NSTimes`, :func:`load_ns_times`). The owner plan is ``dmuon_ownership``'s
``plan_owners``, the call the runtime makes. On a :class:`GPU` (one of :data:`GPUS`, or a memory
size), :attr:`Forecast.fit` (a :class:`Fit`) says whether each setup fits and predicts its step
time with each mesh axis at its bandwidth (:class:`Links`). ``dmuon-plan`` prints the report.
Pure Python: nothing is allocated and torch is not used.
"""

from ._figures import Forecast, RankFigures
from ._fit import Fit
from ._forecast import forecast
from ._gpus import GPU, Link, Links
from ._gpus import GPUS as _GPUS
from ._model_shapes import ModelShapes, model_shapes
from ._ns_times import NSTimes, load_ns_times
from ._spread import Spread
from ._topology import Topology

#: The cards ``forecast(..., gpu=NAME)`` and ``dmuon-plan --gpu-memory NAME`` know, by name
#: (``"h200"``, ``"h100-80g"``, ``"h100-94g"``, ``"a100-80g"``, ``"a100-40g"``): datasheet
#: rates and the servers' links (see [Note: GPUs and links]).
GPUS = _GPUS

__all__ = [
    "GPU",
    "GPUS",
    "Fit",
    "Forecast",
    "Link",
    "Links",
    "ModelShapes",
    "NSTimes",
    "RankFigures",
    "Spread",
    "Topology",
    "forecast",
    "load_ns_times",
    "model_shapes",
]
