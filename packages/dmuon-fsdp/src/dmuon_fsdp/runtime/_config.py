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
    a bad value, naming the argument and what it takes."""

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
