"""The hooks a ``Muon.step`` runs: pre-step hooks before anything is stepped, post-update hooks
after the update and before the publish, and what happens when one of them raises.

[Note: a hook that raises]
A post-update hook runs on every rank between the update and the publish. When one raises,
the step still publishes (the weights as the update and the hooks that ran left them, so every
replica equals its owner) and then re-raises on the rank where it raised, whatever it raised (a
``KeyboardInterrupt`` from Ctrl-C in a hook too): a step that stopped before its publish would
leave the owners with the new weights and their replicas with the old ones, and a run that
caught the error would go on with replicas that differ. Changes a raising hook made before it
raised stay, as with any exception in place.

The other ranks learn of it without waiting for the device: every step with post-update hooks
launches one SUM all-reduce of "a hook raised here" over every rank on the host (a CPU tensor
over a gloo group, see ``DedicatedCommContext.host_group``), which nothing waits for; the next
``step()`` reads it (long complete by then) before it changes anything. If a hook raised on some ranks but not on all, every rank raises
there, naming those ranks, and that step is applied nowhere; a rank that already raised the
hook's own exception raises this one too, so that no rank goes on alone. If it raised on
every rank, every rank has already seen the exception, and the next step goes on.

A pre-step hook runs before the step's collectives, so a rank whose pre-step hook raised
leaves the step while the others enter them and wait for it: nothing can tell them without a
collective in every step. A pre-step hook must behave alike on every rank (raise everywhere or
nowhere), as any code that issues collectives must; ``register_pre_step_hook`` says so.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from ..holder import WeightPart

__all__ = ["PostUpdateHook", "PreStepHook", "StepHooks"]

# ``hook(optimizer, parts)``: see [Note: the post-update hook] in _step_plan.
# (The optimizer is typed ``Any`` here: this module sits below ``_optimizer``.)
PostUpdateHook = Callable[[Any, Mapping[str, WeightPart]], None]
# ``hook(optimizer)``, before the step waits for the gradient reduces: start work the
# post-update hooks need (QK-clip's all-reduce of its statistic).
PreStepHook = Callable[[Any], None]


class _Outcome:
    """One step's count of ranks whose post-update hooks raised, summed on the host (a CPU
    tensor over a gloo group: no device work, so nothing waits for the device)."""

    def __init__(self, raised: bool, group: ProcessGroup | None) -> None:
        self.count = torch.tensor([float(raised)])
        self.world = 1 if group is None else dist.get_world_size(group)
        self._work = None
        if group is not None and self.world > 1:
            self._work = dist.all_reduce(
                self.count, op=dist.ReduceOp.SUM, group=group, async_op=True
            )

    def ranks_raised(self) -> int:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return round(float(self.count.item()))

    def partial(self) -> bool:
        raised = self.ranks_raised()
        return 0 < raised < self.world


def _layout(tensor: torch.Tensor) -> tuple[int, torch.Size, torch.dtype]:
    """Where and how a part's values live: a hook may change them, never this."""
    return tensor.data_ptr(), tensor.shape, tensor.dtype


class StepHooks:
    """The hooks of one optimizer (see [Note: a hook that raises])."""

    def __init__(self, host_group: Callable[[], ProcessGroup | None]) -> None:
        # OrderedDicts: RemovableHandle keeps a weak reference to them.
        self.pre_step: OrderedDict[int, PreStepHook] = OrderedDict()
        self.post_update: OrderedDict[int, PostUpdateHook] = OrderedDict()
        self._host_group = host_group
        self._last: _Outcome | None = None

    @staticmethod
    def _register(
        hooks: OrderedDict[int, Any], hook: object, *, prepend: bool = False
    ) -> RemovableHandle:
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        if prepend:
            hooks.move_to_end(handle.id, last=False)
        return handle

    def add_pre_step(self, hook: PreStepHook) -> RemovableHandle:
        return self._register(self.pre_step, hook)

    def add_post_update(self, hook: PostUpdateHook, *, prepend: bool = False) -> RemovableHandle:
        return self._register(self.post_update, hook, prepend=prepend)

    def before_step(self, optimizer: Any) -> None:
        """Raise, on every rank alike, if a post-update hook of the last step raised on some
        ranks only; then run the pre-step hooks."""
        last, self._last = self._last, None
        if last is not None and last.partial():
            raise RuntimeError(
                f"a post-update hook raised on {last.ranks_raised()} of {last.world} ranks in "
                "the previous step (the step was applied and published everywhere); this step "
                "is applied nowhere. Fix the hook so that it behaves alike on every rank: each "
                "rank that raised reported the hook's own exception"
            )
        for hook in list(self.pre_step.values()):
            hook(optimizer)

    def run_post_update(
        self, optimizer: Any, parts: Callable[[], Mapping[str, WeightPart]]
    ) -> BaseException | None:
        """Run the post-update hooks; return the exception one raised (the caller publishes,
        then raises it), and share whether one did with every rank."""
        if not self.post_update:
            return None
        error: BaseException | None = None
        try:
            given = MappingProxyType(parts())  # read-only: a replaced part goes nowhere
            before = {name: _layout(part.tensor) for name, part in given.items()}
            for hook in list(self.post_update.values()):
                hook(optimizer, given)
            moved = [name for name, part in given.items() if _layout(part.tensor) != before[name]]
            if moved:
                raise RuntimeError(
                    "a post-update hook gave these parts another storage, shape or dtype: "
                    + ", ".join(moved[:4])
                    + (f" and {len(moved) - 4} more" if len(moved) > 4 else "")
                    + "; the weights then no longer reach what the forward reads. Change a"
                    " part's tensor in place (mul_, copy_, clamp_ ...), never through .data ="
                    " or resize_"
                )
        except BaseException as exc:  # a KeyboardInterrupt too: the publish comes first
            error = exc
        self._last = _Outcome(error is not None, self._host_group())
        return error
