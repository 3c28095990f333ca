"""The rule every dmuon package's ``warn`` follows: a warning names the first caller outside
dmuon's packages, torch and the training libraries of Hugging Face (``transformers``,
``accelerate``) and Lightning, whatever lies between (see [Note: a warning's line] in
``dmuon_fsdp._warnings``).

    from dmuon_testing.warning_line import check_warning_line

    check_warning_line(warn, "dmuon_ns._graphs")

Each route is a chain of functions, one per module (each compiled with the module's
``__name__`` and a file named ``<module>``), the innermost one, in the package, calling
``warn``.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable

__all__ = ["check_warning_line"]

# Routes from the caller to the package (outermost first), and the frame the warning names:
# None for the caller's own line.
_ROUTES: tuple[tuple[tuple[str, ...], str | None], ...] = (
    (("torch.optim.lr_scheduler",), None),  # Muon.step() through the scheduler's wrapper
    # trainer.train(): the Trainer's loop, accelerate's optimizer wrapper, the scheduler's.
    (("transformers.trainer", "accelerate.optimizer", "torch.optim.lr_scheduler"), None),
    (("transformers.trainer", "transformers.trainer_callback"), None),  # a Trainer callback
    # A transformers model's forward, reaching dmuon's hooks.
    (("transformers.models.llama.modeling_llama", "torch.nn.modules.module"), None),
    # The user's own code within the Trainer's loop (a callback of theirs) is their line.
    (("transformers.trainer", "my_callbacks", "accelerate.optimizer"), "<my_callbacks>"),
    # trainer.fit() of Lightning: Muon.step() from the precision plugin, and the backward
    # that the step's closure runs (dmuon's hooks, NS during backward).
    (
        (
            "lightning.pytorch.trainer.trainer",
            "lightning.pytorch.loops.fit_loop",
            "lightning.pytorch.core.optimizer",
            "lightning.pytorch.plugins.precision.precision",
            "torch.optim.optimizer",
        ),
        None,
    ),
    (
        (
            "pytorch_lightning.trainer.trainer",
            "pytorch_lightning.plugins.precision.precision",
            "dmuon_fsdp.optim._optimizer",
            "pytorch_lightning.loops.optimization.automatic",
            "pytorch_lightning.core.module",
            "torch._tensor",
        ),
        None,
    ),
    # Fabric: the user's optimizer.step() on the optimizer fabric.setup() wrapped.
    (("lightning_fabric.wrappers", "lightning_fabric.plugins.precision.precision"), None),
    # The user's own LightningModule hook (optimizer_step) within the loop is their line.
    (
        ("lightning.pytorch.trainer.call", "my_module", "lightning.pytorch.core.optimizer"),
        "<my_module>",
    ),
)


def _through(modules: tuple[str, ...], body: str, names: dict[str, object]) -> Callable[[], None]:
    """A function of the last of ``modules`` running ``body`` (with ``names``), called through
    one function of each module before it (the first outermost)."""
    call: object = None
    for module in reversed(modules):
        scope: dict[str, object] = {"__name__": module, "call": call, **names}
        exec(compile(f"def through():\n    {body}\n", f"<{module}>", "exec"), scope)
        call, body = scope["through"], "call()"
    assert callable(call)
    return call


def check_warning_line(warn: Callable[[str, type[Warning]], None], package_module: str) -> None:
    """Raise ``AssertionError`` unless ``warn`` called in ``package_module`` (a module of the
    package, such as ``"dmuon_ns._graphs"``) names the caller's line on every route of
    ``_ROUTES``, or the route's own frame named there."""
    for modules, named in _ROUTES:
        route = _through(
            (*modules, package_module), 'warn("a warning", RuntimeWarning)', {"warn": warn}
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = sys._getframe().f_lineno + 1
            route()
        got = [(w.filename, w.lineno) for w in caught]
        want = [(__file__, line)] if named is None else [(named, 2)]
        assert got == want, (modules, got, want)
