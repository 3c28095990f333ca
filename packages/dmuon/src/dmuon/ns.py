"""Newton–Schulz: the orthogonalisation Muon runs, usable on its own (re-exported from
``dmuon_ns``).

    from dmuon.ns import newton_schulz, NewtonSchulz, get_backend_status

A kernel of your own (an ``NSKernel``) joins the built-in ones through ``register_kernel``;
``tune_pending`` measures, where a stall is welcome, the shapes no kernel verdict covers yet.
"""

from dmuon_ns import POLAR_EXPRESS_COEFFICIENTS as POLAR_EXPRESS_COEFFICIENTS
from dmuon_ns import QUINTIC_COEFFICIENTS as QUINTIC_COEFFICIENTS
from dmuon_ns import YOU_COEFFICIENTS as YOU_COEFFICIENTS
from dmuon_ns import BackendStatus as BackendStatus
from dmuon_ns import KernelAvailability as KernelAvailability
from dmuon_ns import NewtonSchulz as NewtonSchulz
from dmuon_ns import NSKernel as NSKernel
from dmuon_ns import direct_newton_schulz as direct_newton_schulz
from dmuon_ns import get_backend_status as get_backend_status
from dmuon_ns import get_ns_backend as get_ns_backend
from dmuon_ns import gram_newton_schulz as gram_newton_schulz
from dmuon_ns import newton_schulz as newton_schulz
from dmuon_ns import register_kernel as register_kernel
from dmuon_ns import tune_pending as tune_pending

__all__ = sorted(n for n in dict(globals()) if not n.startswith("_"))
