"""The clip under ``torch.compile``: dmuon-clip's entry points that take dmuon's optimizer run
eagerly when a compiled function calls them.

[Note: the clip under torch.compile]
``clip_grad_norm_``, ``clip_grads_with_norm_``, ``clip_grad_value_`` and
``try_clip_optimizer_grad_norm_buckets_`` take the gradients from the optimizer (dmuon's Muon
waits for its gradient reduces and TP gathers there), validate Python arguments, reduce norms
over the ranks and read strategies from a registry. Traced by dynamo (a compiled train step
that calls the clip between ``backward()`` and ``step()``, a habit with
``torch.nn.utils.clip_grad_norm_``) the clip and the optimizer's ``muon_grads_for_clip`` /
``grads_for_clip`` split into pieces (two steps of ``clip_grad_norm_`` on 2 gloo ranks, torch
2.13: 16 graph breaks on non-tensor values, at the profiler query of ``_profiling.span``, 2 at
``Work.wait``, 63 graph nodes from dmuon-clip's and the optimizer's code), and
``fullgraph=True`` refused them with an error that named that private torch call, neither the
cause nor the fix, for nothing worth compiling: the clip is a few foreach kernels and one
collective. So a compiled caller runs each of them eagerly, one graph break, which dynamo's
log and ``fullgraph=True``'s error name with the reason and the fix (``UNTRACED_REASON``), as
dmuon's ``Muon.step`` does (its [Note: the step under torch.compile]); eager calls do not go
through the wrapper.

``torch.compiler.disable(fn, reason=...)``, which gives dynamo the reason, imports the compiler
when applied, and importing dmuon must not import it; nor can it be applied while dynamo traces
(dynamo refuses to trace ``torch.compiler.disable`` itself), and a compiled clip may be the first
call of the process. ``untraced`` therefore applies ``torch._disable_dynamo`` (which imports the
compiler on the wrapper's first call) and gives the wrapper the two attributes
``torch.compiler.disable`` gives its own (``_torchdynamo_disable``, and the reason in
``_torchdynamo_disable_msg``), which dynamo reads where it meets the wrapper: the wrapper lives
in a file dynamo skips, so dynamo breaks the graph there quoting the reason.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

__all__ = ["UNTRACED_REASON", "eager_under_compile", "untraced"]

_P = ParamSpec("_P")
_T = TypeVar("_T")

# Quoted by dynamo's graph-break log and by the error of fullgraph=True; formatted with the
# entry point's name as dmuon exports it.
UNTRACED_REASON = (
    "{} runs eagerly under torch.compile (one graph break): it takes the gradients from the "
    "optimizer, which waits for the gradient reduces, and issues collectives. Call it outside "
    "the compiled function (after backward(), before optimizer.step(): compile the model, its "
    "blocks or the loss), or compile it without fullgraph=True; see dmuon's torch.compile guide"
)


def untraced(fn: Callable[_P, _T], name: str) -> Callable[_P, _T]:
    """``fn``, run eagerly by a compiled caller, which dynamo tells with ``UNTRACED_REASON``
    for ``name``; importing nothing now (see [Note: the clip under torch.compile])."""
    wrapper = torch._disable_dynamo(fn)
    # What torch.compiler.disable(fn, reason=...) sets on its wrapper, and dynamo reads.
    wrapper._torchdynamo_disable = True  # type: ignore[attr-defined]
    wrapper._torchdynamo_disable_msg = UNTRACED_REASON.format(name)  # type: ignore[attr-defined]
    return wrapper


def eager_under_compile(name: str) -> Callable[[Callable[_P, _T]], Callable[_P, _T]]:
    """A decorator: the decorated entry point (dmuon exports it as ``name``) runs as it is when
    called eagerly, and through its ``untraced`` twin when a compiled function calls it (see
    [Note: the clip under torch.compile])."""

    def decorate(fn: Callable[_P, _T]) -> Callable[_P, _T]:
        twin = untraced(fn, name)

        @functools.wraps(fn)
        def entry(*args: _P.args, **kwargs: _P.kwargs) -> _T:
            if torch.compiler.is_compiling():
                return twin(*args, **kwargs)
            return fn(*args, **kwargs)

        return entry

    return decorate
