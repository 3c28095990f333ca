"""The NS kernel registry and the one place that decides which kernel runs.

[Note: kernel precedence]
``resolve()`` applies, first match wins:

1. an explicit ``kernel=`` other than ``"auto"`` (``NewtonSchulz`` refuses one other than
   ``"torch"`` with fp32 iterations);
2. fp32 iterations (``dtype=torch.float32``), which only the torch kernel runs: Triton's and
   quack's products take fp16 and bf16 (Triton's fp32 dot would be TF32);
3. the environment override ``DMUON_NS_KERNEL`` (read by ``_environment.kernel_override``;
   ``"auto"`` or empty means unset);
4. ``deterministic=True``, which means the plain torch kernel (cuBLAS products, no autotune
   whose choice could differ between runs or machines);
5. auto: on CUDA every available kernel in ``AUTO_PRIORITY`` order, for ``_autotune`` to pick
   from per problem; on any other device the torch kernel, because the accelerated kernels are
   CUDA kernels (the Triton interpreter on CPU exists for tests, which ask for it by name).

A kernel named by 1 or 3 that cannot run on the device is an error carrying the kernel's own
``unavailable_reason`` (an install hint), never a silent fallback: whoever names a kernel wants
to measure or rely on it. Auto always runs something and says what (``get_ns_backend``).

[Note: optional kernels load lazily]
The Triton and quack kernels live in modules that import heavy optional dependencies only when
a kernel first runs. Importing ``dmuon_ns`` imports neither module; the first ``resolve()`` (or
status query) that needs them imports each. A module that cannot be imported (``ImportError``)
leaves its kernel unavailable with the error and the install hint as the reason; any other
error is a bug and propagates.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor

from dmuon_ns._coefficients import CoefficientRows
from dmuon_ns._environment import KERNEL_ENV, kernel_override
from dmuon_ns._torch_kernel import TORCH_KERNEL

__all__ = [
    "AUTO_PRIORITY",
    "KERNEL_ENV",
    "NSKernel",
    "NSKernelUnavailableError",
    "Problem",
    "Resolution",
    "clear_resolution_cache",
    "cuda_capability_reason",
    "install_hint",
    "kernel_names",
    "kernel_status",
    "register_kernel",
    "resolve",
    "unknown_kernel",
]

logger = logging.getLogger(__name__)


def unknown_kernel(source: str, name: str) -> ValueError:
    """The error for a kernel ``name`` that no kernel registered here has, asked for by
    ``source`` (``kernel=`` or the environment variable): the known names, and how a kernel
    of one's own becomes known."""
    return ValueError(
        f"{source}: unknown NS kernel {name!r}; known kernels are 'auto', "
        + ", ".join(repr(k) for k in kernel_names())
        + "; a kernel of your own is registered with dmuon_ns.register_kernel(kernel) in every"
        " process before its first use"
    )


# Optional kernels: name -> (module that registers it on import, install hint: dmuon-ns's extra).
_OPTIONAL_KERNELS: dict[str, tuple[str, str]] = {
    "triton": ("dmuon_ns._triton_backend", "pip install 'triton>=3.4'"),
    "quack": (
        "dmuon_ns._quack_backend",
        "pip install 'quack-kernels>=0.6.5' 'nvidia-cutlass-dsl>=4.8.1'",
    ),
}
# Order in which auto offers candidates to the autotuner (first = preferred on a tie).
AUTO_PRIORITY: tuple[str, ...] = ("quack", "triton", "torch")


class Problem(Protocol):
    """A kernel's input, described: a tensor, or the front end's ``Prepared`` before the input
    is written (what the autotuner's verdicts and the graphs' keys depend on)."""

    @property
    def shape(self) -> torch.Size: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def device(self) -> torch.device: ...


@runtime_checkable
class NSKernel(Protocol):
    """What a kernel implements. ``x`` is (batch, m, n) with batch ≥ 1 and m ≤ n, contiguous,
    fp16/bf16 (fp32 only for the torch kernel: ``_prepare``'s [Note: the iteration dtype]),
    already normalised; the result has the same shape, in ``out_dtype`` (``None``: ``x``'s
    dtype), which a kernel should write from its last product rather than cast afterwards.
    ``coefficients`` has exactly one row per step; ``restart_iterations`` are the steps at which
    Gram NS rebuilds its Gram matrix from the iterate (``_iterations``' [Note: the Gram
    iteration]). The dispatcher passes every argument by position, so a kernel names its
    parameters as it likes. A kernel may also say which exceptions mean it cannot run a problem
    (``failure_types()``, see ``_measure``'s [Note: a kernel that fails])."""

    name: str

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Why the kernel cannot run on ``device`` (a missing package, an old GPU), or
        ``None`` when it can; auto leaves out a kernel that cannot."""
        ...

    def gram(
        self,
        x: Tensor,
        coefficients: CoefficientRows,
        restart_iterations: Sequence[int],
        out_dtype: torch.dtype | None = None,
        /,
    ) -> Tensor:
        """Gram Newton–Schulz of ``x``: one step per row of ``coefficients``, the Gram matrix
        rebuilt from the iterate at each step of ``restart_iterations``."""
        ...

    def direct(
        self,
        x: Tensor,
        coefficients: CoefficientRows,
        out_dtype: torch.dtype | None = None,
        /,
    ) -> Tensor:
        """Direct Newton–Schulz of ``x``: one step ``X ← aX + (bA + cA²)X``, ``A = XXᵀ``, per
        row ``(a, b, c)`` of ``coefficients``."""
        ...


def install_hint(name: str) -> str:
    """How to install what the optional kernel ``name`` needs (for its ``unavailable_reason``)."""
    return _OPTIONAL_KERNELS[name][1]


def cuda_capability_reason(device: torch.device, min_major: int) -> str | None:
    """Why the CUDA ``device`` cannot run a kernel that needs SM``min_major``0 or newer, or
    ``None`` when it can (for kernels' ``unavailable_reason``)."""
    if not torch.cuda.is_available():
        return "needs a CUDA device, and torch sees none"
    major, minor = torch.cuda.get_device_capability(device)
    if major < min_major:
        return f"needs a CUDA device of SM{min_major}0 or newer, this one is SM{major}{minor}"
    return None


class NSKernelUnavailableError(RuntimeError):
    """A kernel asked for by name (``kernel=`` or ``DMUON_NS_KERNEL``) cannot run here."""


class Resolution(NamedTuple):
    """The outcome of ``resolve``: the kernels to run (one, or several auto candidates in
    priority order), the rule that chose them and a human-readable reason."""

    kernels: tuple[NSKernel, ...]
    rule: str  # "kernel=", "dtype", "DMUON_NS_KERNEL", "deterministic", "auto"
    reason: str


_lock = threading.Lock()
_kernels: dict[str, NSKernel] = {TORCH_KERNEL.name: TORCH_KERNEL}
_import_failures: dict[str, str] = {}
_optional_loaded = False
_cache: dict[tuple[str, bool, torch.device, str | None, bool], Resolution] = {}
# See kernel_choices_version.
_choices_version = 0


def kernel_choices_version() -> int:
    """A number that changes whenever the kernel some NS problem runs may change: a kernel
    registered, a problem measured (``tune``, ``tune_pending``), a verdict's kernel that failed
    and fell back, the autotune cache cleared. A caller that captures NS calls in a CUDA graph
    of its own (which replays the kernels it captured) recaptures when it changes."""
    return _choices_version


def choices_changed() -> None:
    """Advance :func:`kernel_choices_version` (the registry and the autotuner call this)."""
    global _choices_version
    with _lock:
        _choices_version += 1


def register_kernel(kernel: NSKernel) -> None:
    """Make ``kernel`` available under ``kernel.name`` (replacing a kernel of that name), in
    this process: ``kernel=`` and ``DMUON_NS_KERNEL`` then select it, as the built-in ones.

    Args:
        kernel: an :class:`NSKernel`: a ``name`` (a non-empty string other than ``"auto"``),
            ``unavailable_reason(device)`` and the ``gram`` and ``direct`` iterations; anything
            else raises ``ValueError``.
    """
    name = getattr(kernel, "name", None)
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(
            f"register_kernel: kernel.name must be a non-empty string other than 'auto',"
            f" got {name!r}"
        )
    if not isinstance(kernel, NSKernel):
        raise ValueError(
            f"register_kernel: kernel {name!r} must implement unavailable_reason(device),"
            " gram(x, coefficients, restart_iterations, out_dtype=None) and"
            " direct(x, coefficients, out_dtype=None)"
        )
    with _lock:
        if name in _kernels and _kernels[name] is not kernel:
            logger.debug("dmuon-ns: kernel %r replaced by %r", name, kernel)
        _kernels[name] = kernel
        _import_failures.pop(name, None)
        _cache.clear()
    choices_changed()


def clear_resolution_cache() -> None:
    """Forget cached ``resolve`` answers. Availability is assumed fixed for a process; tests
    that change what a kernel's ``unavailable_reason`` depends on (``TRITON_INTERPRET``, say)
    call this."""
    with _lock:
        _cache.clear()


def kernel_names() -> tuple[str, ...]:
    """Every kernel name ``kernel=`` accepts (registered or loadable), without importing."""
    with _lock:
        return tuple(dict.fromkeys([*AUTO_PRIORITY, *_OPTIONAL_KERNELS, *_kernels]))


def _load_optional() -> None:
    global _optional_loaded
    if _optional_loaded:
        return
    for name, (module, hint) in _OPTIONAL_KERNELS.items():
        try:
            importlib.import_module(module)
        except ImportError as err:
            reason = f"{module} could not be imported ({err}); install with {hint}"
        else:
            if name in _kernels:
                continue
            reason = f"{module} imported but registered no kernel named {name!r}"
        with _lock:
            _import_failures[name] = reason
    _optional_loaded = True


def _unavailable(name: str, device: torch.device) -> str | None:
    kernel = _kernels.get(name)
    if kernel is None:
        return _import_failures.get(name, f"kernel {name!r} is not registered")
    return kernel.unavailable_reason(device)


def kernel_status(device: torch.device) -> dict[str, str | None]:
    """name -> reason it cannot run on ``device`` (``None`` when it can), for every kernel."""
    _load_optional()
    return {name: _unavailable(name, device) for name in kernel_names()}


def resolve(
    kernel: str,
    deterministic: bool,
    device: torch.device,
    *,
    use_env: bool = True,
    fp32: bool = False,
) -> Resolution:
    """Decide which kernel(s) run on ``device`` (see the precedence note); ``fp32``: the
    iterations run in fp32. ``use_env=False`` answers as if ``DMUON_NS_KERNEL`` were unset
    (for status reports)."""
    env = kernel_override() if use_env else None
    key = (kernel, deterministic, device, env, fp32)
    cached = _cache.get(key)
    if cached is not None:
        return cached
    resolution = _resolve(kernel, deterministic, device, env, fp32)
    with _lock:
        _cache[key] = resolution
    return resolution


def _resolve(
    kernel: str, deterministic: bool, device: torch.device, env: str | None, fp32: bool
) -> Resolution:
    if kernel != "auto":
        return _named(kernel, "kernel=", f"kernel={kernel!r} was asked for", device)
    if fp32:
        return Resolution(
            (TORCH_KERNEL,), "dtype", "dtype=torch.float32 runs plain torch (fp32 products)"
        )
    if env is not None:
        name = env.lower()
        return _named(name, KERNEL_ENV, f"{KERNEL_ENV}={env!r} overrides auto", device)
    if deterministic:
        return Resolution((TORCH_KERNEL,), "deterministic", "deterministic=True runs plain torch")
    if device.type != "cuda":
        return Resolution(
            (TORCH_KERNEL,),
            "auto",
            f"auto on {device.type}: the accelerated kernels need CUDA, plain torch runs",
        )
    _load_optional()
    candidates = tuple(
        _kernels[name]
        for name in dict.fromkeys([*AUTO_PRIORITY, *_kernels])
        if name in _kernels and _unavailable(name, device) is None
    )
    if not candidates:
        candidates = (TORCH_KERNEL,)
    names = ", ".join(k.name for k in candidates)
    if len(candidates) == 1:
        reason = f"auto: {names} is the only kernel available here"
    else:
        reason = f"auto: per problem, the kernel of its verdict among {names} (torch without one)"
    return Resolution(candidates, "auto", reason)


def _named(name: str, rule: str, why: str, device: torch.device) -> Resolution:
    if name not in kernel_names():
        source = "kernel" if rule == "kernel=" else f"the {KERNEL_ENV} environment variable"
        raise unknown_kernel(source, name)
    if name in _OPTIONAL_KERNELS:
        _load_optional()
    reason = _unavailable(name, device)
    if reason is not None:
        fix = "pass kernel='auto'" if rule == "kernel=" else f"unset {KERNEL_ENV}"
        raise NSKernelUnavailableError(
            f"NS kernel {name!r} ({why}) cannot run on {device}: {reason}. Install what it"
            f" needs, or {fix} to let dmuon-ns pick an available kernel."
        )
    return Resolution((_kernels[name],), rule, why)
