"""The options of :func:`dedicate_params`, validated once, where they are made."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from .._checks import check_bool, is_int
from ..topology import ProcessGroupPolicy

__all__ = ["BoundaryPredicate", "DedicateConfig"]

BoundaryPredicate = Callable[[nn.Module], bool]


@dataclass(frozen=True)
class DedicateConfig:
    """The options of :func:`dedicate_params` that shape the runtime: given one by one as its
    keywords, or built once and passed whole as ``dedicate_params(..., config=...)``. Raises on
    a bad value, naming the argument and what it takes.

    Args:
        reshard_after_forward: ``True`` (Z3): after a boundary's forward, every rank but the
            owner frees the owner's broadcast weights, and the owner broadcasts them again
            before backward. ``False`` (Z2): peers keep them until backward, one broadcast
            round fewer per step for the memory of every layer's full weights. Pass the same
            value to ``fully_shard``. A bool.
        hook_boundary_predicate: ``predicate(module) -> bool``; a dedicated parameter is
            gathered and reduced with its hook boundary, the lowest module on its path (the
            module that holds it, then its parents up to the root) for which this returns
            ``True``. ``None``: the lowest such module that is an item of an ``nn.ModuleList``
            (``layers.N``, ``blocks.N``, ``h.N``) or is named ``layers.N`` / ``blocks.N``.
        hook_boundary_strict: ``True`` raises ``ValueError`` at ``dedicate_params`` for a
            dedicated parameter that has no hook boundary; ``False`` hooks it at the root
            module (its weight then stays gathered for the whole forward and backward). A bool.
        process_group_policy: where dmuon's collectives run: ``"isolated"`` (dmuon's own
            process groups over the mesh's ranks, so that the trainer's collectives never
            interleave with dmuon's asynchronous ones) or ``"shared"`` (the mesh's own groups:
            fewer communicators, the ordering left to the caller). A string or
            ``ProcessGroupPolicy``; anything else raises ``ValueError``.
        small_param_threshold: an int >= 0, in elements: the dedicated parameters of one hook
            boundary smaller than this are planned as one unit with one owner (one collective
            instead of one each); ``0`` turns that packing off.
        patch_fully_shard: ``True`` installs the ``fully_shard`` patch
            (:func:`~dmuon.runtime.install_patch`), so that a plain ``fully_shard`` skips the
            dedicated parameters; ``False`` installs nothing, and every ``fully_shard`` call
            must then pass ``ignored_params=dmuon.dedicated_params_of(model)``. A bool.
        replicated: ``True`` is the replicated (DDP) path, :func:`dedicate_params_ddp`'s: every
            rank keeps every weight whole and the owners broadcast their updates after each
            step. :func:`dedicate_params` refuses a config with ``True``; a bool.
        debug_fence: ``True`` waits for every collective dmuon has in flight and runs a barrier
            on each of dmuon's groups at the end of every ``step()`` (and of every weight
            publish), removing the overlap across steps: for diagnosing ordering problems only,
            never for speed. A bool.
    """

    # Z3 (True): free peers' weights after forward and broadcast again for backward; Z2 keeps.
    reshard_after_forward: bool = True
    # Lowest ancestor module for which this returns True hooks a parameter's collectives;
    # None: the nearest ancestor that is an item of an ``nn.ModuleList`` (``layers.N``,
    # ``blocks.N``, ``h.N``) or is named ``layers.N`` / ``blocks.N``.
    hook_boundary_predicate: BoundaryPredicate | None = None
    # Raise when a dedicated parameter has no boundary (False: hook it at the root module).
    hook_boundary_strict: bool = True
    process_group_policy: ProcessGroupPolicy = ProcessGroupPolicy.ISOLATED
    # Parameters below this many elements are packed with others of their boundary and owner.
    small_param_threshold: int = 5_000_000
    # Wrap FSDP2's module/state discovery so that a plain fully_shard skips dedicated
    # parameters (False: pass ignored_params to every fully_shard); see [Note: FSDP2
    # integration] in _fsdp_integration. The replicated path calls no fully_shard.
    patch_fully_shard: bool = True
    # The replicated (DDP) path: every rank keeps every weight whole for forward and backward;
    # after a step the owners broadcast their updates (see [Note: the replicated path]).
    replicated: bool = False
    # Drain and barrier every dmuon group at the end of ``after_step``: for diagnosing
    # ordering problems only, it removes the cross-step overlap (never for benchmarks).
    debug_fence: bool = False

    def __post_init__(self) -> None:
        if is_int(self.reshard_after_forward):
            raise TypeError(
                f"reshard_after_forward must be a bool, got {self.reshard_after_forward!r}:"
                " dmuon has no partial reshard (FSDP2's int reshards to a smaller group after"
                " forward). Pass the int to fully_shard only, and True (Z3) or False (Z2) here"
            )
        for name in (
            "reshard_after_forward",
            "hook_boundary_strict",
            "patch_fully_shard",
            "replicated",
            "debug_fence",
        ):
            check_bool(name, getattr(self, name))
        if self.hook_boundary_predicate is not None and not callable(self.hook_boundary_predicate):
            raise TypeError(
                "hook_boundary_predicate must be None or a callable (module) -> bool, e.g. "
                "lambda m: hasattr(m, '_is_action_layer')"
            )
        threshold = self.small_param_threshold
        if not is_int(threshold) or threshold < 0:
            raise ValueError(
                f"small_param_threshold must be an int >= 0 (elements), got {threshold!r}"
            )
        object.__setattr__(
            self, "process_group_policy", ProcessGroupPolicy.parse(self.process_group_policy)
        )
