"""What NS will run here, in words (``get_ns_backend``) and as data (``get_backend_status``).

Both answer for one device: the one given, else the current CUDA device when there is one,
else the CPU. They query the device when called, never at import.
"""

from __future__ import annotations

from typing import TypedDict

import torch

from dmuon_ns._coefficients import (
    POLAR_EXPRESS_COEFFICIENTS,
    QUINTIC_COEFFICIENTS,
    YOU_COEFFICIENTS,
    YOU_SIX_STEP_COEFFICIENTS,
)
from dmuon_ns._config import NewtonSchulz
from dmuon_ns._environment import kernel_override
from dmuon_ns._prepare import iteration_dtype
from dmuon_ns._registry import NSKernelUnavailableError, kernel_status, resolve

__all__ = ["BackendStatus", "KernelAvailability", "get_backend_status", "get_ns_backend"]


class KernelAvailability(TypedDict):
    """Whether one NS kernel runs on the device: ``reason`` is ``None`` where it does, else
    why not (with an install hint where one helps)."""

    available: bool
    reason: str | None


class BackendStatus(TypedDict):
    """What :func:`get_backend_status` returns (a plain ``dict``, JSON-friendly)."""

    device: str  #: the device answered for, e.g. ``"cuda:0"`` or ``"cpu"``
    sm: int | None  #: its compute capability as ``10 * major + minor``; ``None`` off CUDA
    env_override: str | None  #: the kernel ``DMUON_NS_KERNEL`` names; ``None``: unset or ``"auto"``
    auto_choice: str  #: the kernel ``kernel="auto"`` runs, or ``"autotune"``
    auto_candidates: list[str]  #: the kernels auto chooses among
    auto_reason: str
    kernels: dict[str, KernelAvailability]  #: every registered kernel, by name


def _device(device: torch.device | str | None) -> torch.device:
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"device {str(device)!r}: this torch sees no CUDA device"
                " (torch.cuda.is_available() is False); ask about 'cpu', or leave device=None"
            )
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sm(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def get_backend_status(device: torch.device | str | None = None) -> BackendStatus:
    """Availability of every NS kernel on ``device`` and what ``kernel="auto"`` runs there.

    Returns a :class:`BackendStatus` (a plain ``dict``): ``{"device": str, "sm": int | None,
    "env_override": str | None, "auto_choice": str, "auto_candidates": [str, ...],
    "auto_reason": str, "kernels": {name: {"available": bool, "reason": str | None}}}``.
    ``sm`` is the compute capability as ``10 * major + minor`` (``None`` off CUDA).
    ``auto_choice`` is the kernel auto runs, or ``"autotune"`` when several are candidates:
    each problem then runs the kernel of its verdict (measured by ``tune``/``tune_pending`` or
    shipped in the device's table), torch where there is none. It describes ``kernel="auto"``
    without ``DMUON_NS_KERNEL`` (``env_override`` shows that variable).

    Args:
        device: the device to answer for (a ``torch.device`` or a string such as ``"cuda:1"``);
            ``None``: the current CUDA device when CUDA is available, else the CPU.
    """
    dev = _device(device)
    reasons = kernel_status(dev)
    auto = resolve("auto", False, dev, use_env=False)
    names = [k.name for k in auto.kernels]
    return {
        "device": str(dev),
        "sm": _sm(dev),
        "env_override": kernel_override(),
        "auto_choice": names[0] if len(names) == 1 else "autotune",
        "auto_candidates": names,
        "auto_reason": auto.reason,
        "kernels": {
            name: KernelAvailability(available=reason is None, reason=reason)
            for name, reason in reasons.items()
        },
    }


def get_ns_backend(
    config: NewtonSchulz | None = None, device: torch.device | str | None = None
) -> str:
    """One line: the algorithm, its steps, coefficients and iteration dtype, the kernel that
    runs, the device (SM or "cpu") and why.

    For ``config`` (default ``NewtonSchulz()``) on ``device``; e.g. ``"gram NS (direct for
    square), 5 steps of Polar Express coefficients in float32 | kernel torch | cpu | auto on
    cpu: the accelerated kernels need CUDA, plain torch runs"``. The coefficients are named
    when they are one of the published tables (``"Polar Express"``, ``"You"``, ``"You
    six-step"``, ``"quintic"``), else ``"custom"``.

    Args:
        config: the settings to describe; ``None``: ``NewtonSchulz()``, the defaults.
        device: the device to answer for (a ``torch.device`` or a string such as ``"cuda:1"``);
            ``None``: the current CUDA device when CUDA is available, else the CPU.
    """
    if config is not None and not isinstance(config, NewtonSchulz):
        raise TypeError(
            f"get_ns_backend takes a dmuon.NewtonSchulz (or None), got {config!r}; e.g."
            f" get_ns_backend(NewtonSchulz(backend='gram'))"
        )
    config = config if config is not None else NewtonSchulz()
    dev = _device(device)
    sm = _sm(dev)
    where = f"sm{sm}" if sm is not None else dev.type
    algorithm = "gram NS (direct for square)" if config.backend == "gram" else "direct NS"
    steps = f"{config.steps} steps of {_coefficients_name(config.coefficients)} coefficients"
    try:
        resolution = config._resolution(dev)
    except NSKernelUnavailableError as err:
        return f"{algorithm}, {steps} | kernel {config.kernel} unavailable | {where} | {err}"
    names = [k.name for k in resolution.kernels]
    kernel = names[0] if len(names) == 1 else "auto(" + "|".join(names) + ")"
    dtype = str(iteration_dtype(config.dtype, dev, names)).removeprefix("torch.")
    return f"{algorithm}, {steps} in {dtype} | kernel {kernel} | {where} | {resolution.reason}"


def _coefficients_name(coefficients: object) -> str:
    """The name of a published coefficient table, else ``"custom"``."""
    for name, table in (
        ("Polar Express", POLAR_EXPRESS_COEFFICIENTS),
        ("You", YOU_COEFFICIENTS),
        ("You six-step", YOU_SIX_STEP_COEFFICIENTS),
        ("quintic", QUINTIC_COEFFICIENTS),
    ):
        if coefficients == table:
            return name
    return "custom"
