"""The optimizer routes a parameter can take and the dtype names a policy may use."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["DTYPE_ALIASES", "ROUTES", "Route", "normalize_dtype", "parse_route"]


class Route(StrEnum):
    """How one trainable parameter is communicated and updated.

    ``MUON``: one owner holds it whole, broadcasts it to its shard peers and receives the
    averaged gradient by reduce; the owner runs momentum + Newton–Schulz.
    ``ADAMW``: the same owner broadcast / reduce path, but the owner runs AdamW.
    ``SHARDED_ADAMW``: no owner; all-gather / reduce-scatter across every rank and AdamW on the
    local shard (for embeddings and heads, whose traffic every rank should share).
    """

    MUON = "muon"
    ADAMW = "adamw"
    SHARDED_ADAMW = "sharded_adamw"


ROUTES: tuple[str, ...] = tuple(r.value for r in Route)

# Canonical names are torch's attribute names; the runtime maps them with getattr(torch, name).
DTYPE_ALIASES: dict[str, str] = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}


def parse_route(value: object, where: str) -> Route:
    """``value`` as a :class:`Route`; ``where`` names the argument in the error."""
    if isinstance(value, str):
        try:
            return Route(value)
        except ValueError:
            pass
    raise ValueError(
        f"{where}: unknown route {value!r}; use one of {', '.join(repr(r) for r in ROUTES)}"
    )


def normalize_dtype(value: object, where: str) -> str | None:
    """A dtype given as a torch dtype or a name, as its canonical name (or ``None``).

    torch is never imported here: a torch dtype is recognised by its ``str()``
    (``"torch.bfloat16"``), which keeps this package importable without torch.
    """
    if value is None:
        return None
    text = value if isinstance(value, str) else str(value)
    if not isinstance(value, str) and not text.startswith("torch."):
        text = ""  # not a dtype at all: report the object itself below
    key = text.removeprefix("torch.").lower()
    canonical = DTYPE_ALIASES.get(key)
    if canonical is None:
        allowed = ", ".join(repr(k) for k in DTYPE_ALIASES)
        raise ValueError(
            f"{where}: unsupported dtype {value!r}; use torch.bfloat16 / torch.float16 / "
            f"torch.float32, one of the names {allowed}, or None"
        )
    return canonical
