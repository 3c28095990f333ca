"""Before the run: what dmuon will hold per rank and move per step, from a model's config.

from dmuon.plan import forecast, Topology
"""

from dmuon_ownership import Forecast as Forecast
from dmuon_ownership import ModelShapes as ModelShapes
from dmuon_ownership import Topology as Topology
from dmuon_ownership import forecast as forecast
from dmuon_ownership import model_shapes as model_shapes

__all__ = sorted(n for n in dict(globals()) if not n.startswith("_"))
