"""The kinds of holders, and the one place that decides which kind a parameter is.

[Note: the kinds of holders]
``dedicate_params`` asks :func:`kind_of` once for every parameter it selected; the kinds are
asked in the order of ``KINDS``, and the first whose ``claims`` accepts the parameter is its
kind (a parameter routed to ``"sharded_adamw"`` gets none: it stays an ordinary FSDP2
parameter). The kinds, in that order:

1. :class:`~._experts.ExpertStack`: a Muon-route stack of matrices, experts on dim 0; FSDP2
   keeps it and every rank steps its shard (:class:`~._experts.SourcedExpertStack` where the
   plan names expert sources for it);
2. :class:`~._dedicated.TensorParallelParam`: a ``DTensor`` parameter (tensor parallelism),
   packed alone, orthogonalised by ``TensorParallelNS``;
3. :class:`~._dedicated.DedicatedParam`: every other one, a plain ``nn.Parameter`` packed with
   its owner's others for its boundary.

A kind that subclasses :class:`~._dedicated.DedicatedParam` (``dedicated = True``) is planned an
owner and lives in packs; one that subclasses :class:`~._experts.ExpertStack` stays where FSDP2
puts it. Nothing outside this sub-package names a kind: the runtime, the step and the
checkpoints call the holders' verbs (see [Note: parameter holders] in :mod:`._holder`), so a
new kind is one class here, placed in ``KINDS`` before the kinds it narrows, or added for a
while with :func:`register_kind`.
"""

from __future__ import annotations

import inspect

from dmuon_ownership import Route

from ._dedicated import DedicatedParam, TensorParallelParam
from ._experts import ExpertStack
from ._holder import Found, ParamHolder

__all__ = ["KINDS", "KindRegistration", "kind_of", "register_kind"]

KINDS: list[type[ParamHolder]] = [ExpertStack, TensorParallelParam, DedicatedParam]


class KindRegistration:
    """A kind added by :func:`register_kind`; :meth:`remove` takes it out again."""

    def __init__(self, kind: type[ParamHolder]) -> None:
        self.kind = kind

    def remove(self) -> None:
        if self.kind in KINDS:
            KINDS.remove(self.kind)

    def __enter__(self) -> KindRegistration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def register_kind(kind: type[ParamHolder]) -> KindRegistration:
    """Ask ``kind`` before every other kind (it subclasses ``DedicatedParam`` or
    ``ExpertStack``, see [Note: the kinds of holders]), from the next ``dedicate_params`` on; a
    kind registered already moves to the front. Returns a registration whose ``remove()`` (or
    the end of a ``with`` block) takes it out."""
    if not (isinstance(kind, type) and issubclass(kind, ParamHolder)):
        raise TypeError(
            f"register_kind: {kind!r} is not a holder class; a kind subclasses DedicatedParam,"
            " TensorParallelParam or ExpertStack (dmuon_fsdp.holder)"
        )
    if not isinstance(inspect.getattr_static(kind, "claims"), classmethod):
        raise TypeError(
            f"register_kind: {kind.__name__}.claims must be a classmethod,"
            " claims(cls, found) -> bool (add @classmethod)"
        )
    if kind in KINDS:
        KINDS.remove(kind)
    KINDS.insert(0, kind)
    return KindRegistration(kind)


def kind_of(found: Found) -> type[ParamHolder] | None:
    """The kind of holder ``found`` gets (``None``: dmuon leaves it to FSDP2)."""
    if found.policy.route is Route.SHARDED_ADAMW:
        return None
    return next(kind for kind in KINDS if kind.claims(found))
