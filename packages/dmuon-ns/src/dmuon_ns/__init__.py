"""dmuon-ns: Newton–Schulz orthogonalization (Gram and direct), batched, with pluggable kernels.

    import dmuon_ns
    update = dmuon_ns.newton_schulz(grad)                  # Gram NS, fp16, Polar Express
    ns = dmuon_ns.NewtonSchulz(backend="direct", steps=6)  # or a reusable config
    updates = ns([g1, g2, g3])                             # same-shape ones run as one batch

Importing this package imports torch and nothing else: kernels with optional dependencies load
on first use, and no device is queried until a call needs it.
"""

from dmuon_ns._coefficients import (
    POLAR_EXPRESS_COEFFICIENTS,
    QUINTIC_COEFFICIENTS,
    YOU_COEFFICIENTS,
    YOU_SIX_STEP_COEFFICIENTS,
)
from dmuon_ns._config import NewtonSchulz, NSBackend
from dmuon_ns._distributed import gram_newton_schulz_distributed
from dmuon_ns._environment import KERNEL_ENV
from dmuon_ns._newton_schulz import (
    direct_newton_schulz,
    gram_newton_schulz,
    newton_schulz,
    tune_pending,
)
from dmuon_ns._registry import (
    NSKernel,
    NSKernelUnavailableError,
    kernel_choices_version,
    register_kernel,
)
from dmuon_ns._status import (
    BackendStatus,
    KernelAvailability,
    get_backend_status,
    get_ns_backend,
)

__version__ = "0.1.0"

__all__ = [
    "KERNEL_ENV",
    "POLAR_EXPRESS_COEFFICIENTS",
    "QUINTIC_COEFFICIENTS",
    "YOU_COEFFICIENTS",
    "YOU_SIX_STEP_COEFFICIENTS",
    "BackendStatus",
    "KernelAvailability",
    "NSBackend",
    "NSKernel",
    "NSKernelUnavailableError",
    "NewtonSchulz",
    "direct_newton_schulz",
    "get_backend_status",
    "get_ns_backend",
    "gram_newton_schulz",
    "gram_newton_schulz_distributed",
    "kernel_choices_version",
    "newton_schulz",
    "register_kernel",
    "tune_pending",
]
