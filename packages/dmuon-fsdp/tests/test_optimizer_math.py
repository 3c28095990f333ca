"""The owner-step math against torch.optim.Muon / torch.optim.AdamW where the math coincides."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch.optim import _muon as torch_muon_module

from dmuon_fsdp import Muon, StepOptions
from dmuon_fsdp._matrix import LrScaling, lr_scale
from dmuon_fsdp.optim._muon_math import (
    MuonItem,
    adamw_step,
    init_adamw_state,
    make_newton_schulz,
    momentum_update,
    muon_step,
    weight_decay_and_update,
)
from dmuon_ns import NewtonSchulz


def _polar64(x: torch.Tensor) -> torch.Tensor:
    """The exact orthogonal polar factor U Vᵀ in float64: scale-invariant, so it makes
    torch.optim.Muon's EMA momentum and ours produce the same update."""
    u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    return (u @ vh).to(x.dtype)


def _polar64_batch(batch: torch.Tensor) -> torch.Tensor:
    return torch.stack([_polar64(m) for m in batch])


def _our_muon_steps(params, grads_per_step, *, lr, momentum, nesterov, wd, scaling):
    bufs = [torch.zeros_like(p) for p in params]
    for grads in grads_per_step:
        items = [
            MuonItem(p, g, b, momentum, nesterov, lr, wd, lr_scale(p.shape, scaling))
            for p, g, b in zip(params, grads, bufs)
        ]
        muon_step(items, _polar64_batch, max_batch_bytes=None)


@pytest.mark.parametrize(
    ("nesterov", "scaling", "torch_scaling"),
    [
        (True, "moonlight", "match_rms_adamw"),
        (False, "moonlight", "match_rms_adamw"),
        (True, "original", "original"),
        (True, "spectral", "original"),
    ],
)
def test_muon_update_matches_torch_muon(monkeypatch, nesterov, scaling, torch_scaling):
    monkeypatch.setattr(
        torch_muon_module, "_zeropower_via_newtonschulz", lambda g, *a, **k: _polar64(g)
    )
    gen = torch.Generator().manual_seed(0)
    shapes = [(16, 8), (8, 24), (12, 12)]
    ref = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in shapes]
    ours = [p.detach().clone() for p in ref]
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes] for _ in range(4)]
    opt = torch.optim.Muon(
        ref,
        lr=0.03,
        weight_decay=0.1,
        momentum=0.9,
        nesterov=nesterov,
        adjust_lr_fn=torch_scaling,
    )
    for step_grads in grads:
        for p, g in zip(ref, step_grads):
            p.grad = g.clone()
        opt.step()
    _our_muon_steps(ours, grads, lr=0.03, momentum=0.9, nesterov=nesterov, wd=0.1, scaling=scaling)
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a.detach(), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("rescale", [True, False])
def test_a_momentum_warmup_matches_torch_muon_once_the_buffers_are_rescaled(monkeypatch, rescale):
    """The tuning guide's recipe for modded-nanogpt's momentum warm-up: multiplying dmuon's
    sums by (1 − old)/(1 − new) when the momentum changes keeps them 1/(1 − momentum) times
    torch.optim.Muon's running means, so the updates are torch's; without it they drift."""
    monkeypatch.setattr(
        torch_muon_module, "_zeropower_via_newtonschulz", lambda g, *a, **k: _polar64(g)
    )
    gen = torch.Generator().manual_seed(0)
    shapes = [(16, 8), (12, 12)]
    ref = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in shapes]
    ours = [p.detach().clone() for p in ref]
    bufs = [torch.zeros_like(p) for p in ours]
    opt = torch.optim.Muon(ref, lr=0.03, weight_decay=0.1)
    old = opt.param_groups[0]["momentum"]
    for momentum in (0.85, 0.9, 0.95, 0.95):
        grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
        opt.param_groups[0]["momentum"] = momentum
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        opt.step()
        if rescale:
            for b in bufs:
                b.mul_((1 - old) / (1 - momentum))
        old = momentum
        items = [
            MuonItem(p, g, b, momentum, True, 0.03, 0.1, lr_scale(p.shape, "original"))
            for p, g, b in zip(ours, grads, bufs)
        ]
        muon_step(items, _polar64_batch, max_batch_bytes=None)
    close = all(torch.allclose(b, a.detach(), rtol=1e-9, atol=1e-9) for a, b in zip(ref, ours))
    assert close == rescale


def test_torch_keywords_and_step_options_are_refused_with_what_dmuon_takes():
    """Every keyword of torch.optim.Muon that dmuon.Muon does not take, torch.optim.AdamW's
    betas and flags and each StepOptions field passed to Muon() raise a TypeError naming
    dmuon's way."""
    ours = set(inspect.signature(Muon).parameters)
    torch_only = set(inspect.signature(torch.optim.Muon).parameters) - ours
    assert torch_only  # adjust_lr_fn, ns_coefficients, eps, params
    model = torch.nn.Linear(2, 2)
    for name in [*sorted(torch_only), "betas"]:
        with pytest.raises(TypeError, match=f"Muon\\(\\) takes no keyword '{name}'") as error:
            Muon(model, **{name: None})
        assert "is not a keyword of dmuon.Muon" not in str(error.value), name
        if name == "params":  # torch's param groups, passed as params=[{...}, {...}]
            assert "go in param_groups=[{'params': [...], 'weight_decay': 0.0}" in str(error.value)
    for name in StepOptions.__dataclass_fields__:
        with pytest.raises(TypeError, match=f"options=dmuon.StepOptions\\({name}=...\\)"):
            Muon(model, **{name: None})
    # torch.optim.Muon's eps is a floor, not NewtonSchulz's added eps: no value to carry over.
    with pytest.raises(TypeError, match=r"a floor on the norm.*leave it at its default, 1e-7"):
        Muon(model, eps=1e-3)
    # its ns_coefficients, one flat row, is a list of one row to NewtonSchulz
    with pytest.raises(TypeError, match=r"coefficients=\[\(a, b, c\)\]"):
        Muon(model, ns_coefficients=(3.4445, -4.775, 2.0315))
    # torch.optim.AdamW's flags, each named with what dmuon's AdamW does instead.
    adamw = set(inspect.signature(torch.optim.AdamW).parameters) - ours
    for name in sorted(adamw - {"params", "betas", "eps"}):
        with pytest.raises(TypeError, match=f"'{name}': torch.optim.AdamW's {name} is not an"):
            Muon(model, **{name: True})
    with pytest.raises(TypeError, match=r"'foo': foo is not a keyword of dmuon\.Muon$"):
        Muon(model, foo=1)
    # torch.optim.Muon's first argument, the matrices: dmuon's optimizer steps the whole model.
    with pytest.raises(ValueError, match=r"got list;.*the others with AdamW.*replaces both"):
        Muon(list(model.parameters()))


def test_momentum_formulas():
    buf = torch.tensor([1.0, 2.0])
    grad = torch.tensor([0.5, -1.0])
    out = torch.empty(2)
    momentum_update([buf], [grad], [out], 0.9, nesterov=True)
    # buf = 0.9 * [1, 2] + [0.5, -1] = [1.4, 0.8]; nesterov input = grad + 0.9 * buf
    torch.testing.assert_close(buf, torch.tensor([1.4, 0.8]))
    torch.testing.assert_close(out, torch.tensor([0.5 + 0.9 * 1.4, -1.0 + 0.9 * 0.8]))
    momentum_update([buf], [grad], [out], 0.9, nesterov=False)
    torch.testing.assert_close(buf, torch.tensor([0.9 * 1.4 + 0.5, 0.9 * 0.8 - 1.0]))
    assert torch.equal(out, buf)
    # Several matrices at once: each gets what it gets alone.
    for nesterov in (True, False):
        bufs = [torch.randn(3, 4) for _ in range(3)]
        grads = [torch.randn(3, 4) for _ in range(3)]
        alone = [(b.clone(), torch.empty(3, 4)) for b in bufs]
        for (b, o), g in zip(alone, grads):
            momentum_update([b], [g], [o], 0.9, nesterov)
        outs = torch.empty(3, 3, 4)
        momentum_update(bufs, grads, list(outs), 0.9, nesterov)
        for (b, o), kb, ko in zip(alone, bufs, outs):
            assert torch.equal(kb, b) and torch.equal(ko, o)


def test_lr_scale():
    assert lr_scale((64, 256), "moonlight") == pytest.approx(0.2 * 16)
    assert lr_scale((256, 64), LrScaling.ORIGINAL) == pytest.approx(2.0)
    assert LrScaling("spectral") is LrScaling.ORIGINAL  # the other common name
    assert lr_scale((64, 256), "spectral") == 1.0
    assert lr_scale((64, 256), "none") == 1.0
    with pytest.raises(ValueError, match="2-D shape"):
        lr_scale((4,), "moonlight")
    with pytest.raises(ValueError, match="not a valid LrScaling"):
        lr_scale((4, 4), "bogus")


def test_weight_decay_is_decoupled_and_unscaled():
    p = torch.ones(2, 2)
    weight_decay_and_update([p], [torch.ones(2, 2)], lr=0.1, weight_decay=0.5, scale=3.0)
    torch.testing.assert_close(p, torch.full((2, 2), (1 - 0.05) - 0.3))


# Three same-shape matrices, a transposed one and a square one.
SHAPES = [(16, 32), (32, 16), (16, 32), (16, 32), (8, 8)]


class RecordingNS:
    """The NS function for ``muon_step``: Gram NS, recording each stack it gets and returns."""

    def __init__(self) -> None:
        self.ns = make_newton_schulz("gram", 5)
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        out = self.ns(batch)
        self.calls.append((batch.clone(), out))
        return out

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(x.shape) for x, _ in self.calls]


def _items(shapes, seed, nesterov=lambda i: True):
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=gen) for s in shapes]
    bufs = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    return [
        MuonItem(w, g, b, 0.9, nesterov(i), 0.1, 0.2, lr_scale(w.shape, "moonlight"))
        for i, (w, b, g) in enumerate(zip(weights, bufs, grads))
    ]


def test_ns_runs_once_per_shape_and_batching_keeps_each_matrix():
    ns = RecordingNS()
    muon_step(_items(SHAPES, 1), ns, max_batch_bytes=None)
    assert sorted(ns.shapes) == sorted([(3, 16, 32), (1, 32, 16), (1, 8, 8)])
    for batch, out in ns.calls:
        for x, y in zip(batch, out):
            assert y.shape == x.shape
            # One matrix alone gives the same bits as inside a batch (the torch kernel on CPU).
            assert torch.equal(y, ns.ns(x))
            # And it is close to orthogonal: singular values near 1.
            s = torch.linalg.svdvals(y.double())
            assert float(s.max()) < 1.3 and float(s.min()) > 0.5


@pytest.mark.parametrize("wrong", ["first matrix", "not a tensor"])
def test_an_ns_function_returning_another_shape_is_refused_before_the_update(wrong):
    items = _items([(8, 16), (8, 16)], 3)
    before = [(i.weight.clone(), i.buf.clone()) for i in items]

    def bad_ns(x):
        return x[:1] if wrong == "first matrix" else x.tolist()

    with pytest.raises(
        ValueError, match=r"bad_ns.* for a \(batch, m, n\) input of shape \(2, 8, 16\)"
    ):
        muon_step(items, bad_ns, max_batch_bytes=None)
    # The weights were not touched (the momentum is advanced before NS runs).
    assert all(torch.equal(i.weight, w) for i, (w, _) in zip(items, before))

    ns = make_newton_schulz("direct", 7)
    assert ns.backend == "direct" and ns.steps == 7
    assert make_newton_schulz("gram", None).steps == 5
    custom = NewtonSchulz(backend="gram", steps=3)
    assert make_newton_schulz(custom, None) is custom
    assert make_newton_schulz(_polar64_batch, None) is _polar64_batch
    with pytest.raises(ValueError, match="ns_steps=7 was given with a NewtonSchulz ns_backend"):
        make_newton_schulz(custom, 7)
    with pytest.raises(ValueError, match="ns_steps=7 was given with a callable ns_backend"):
        make_newton_schulz(_polar64_batch, 7)
    with pytest.raises(ValueError, match="ns_backend"):
        make_newton_schulz("cholesky", 5)
    with pytest.raises(ValueError, match="ns_steps"):
        make_newton_schulz("gram", 0)


def test_adamw_step_matches_torch_adamw():
    # torch.optim.AdamW(fused=True), bit for bit: the kernel every step runs (see adamw_step).
    gen = torch.Generator().manual_seed(2)
    ref = [torch.nn.Parameter(torch.randn(5, 3, generator=gen)), torch.nn.Parameter(torch.randn(7))]
    ours = [p.detach().clone() for p in ref]
    states = [init_adamw_state(p) for p in ours]
    opt = torch.optim.AdamW(
        ref, lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05, fused=True
    )
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=gen) for p in ref]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        opt.step()
        adamw_step(ours, grads, states, lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)
    for a, b, s in zip(ref, ours, states):
        assert torch.equal(a.detach(), b)
        assert torch.equal(opt.state[a]["exp_avg_sq"], s["exp_avg_sq"])
        assert float(s["step"]) == 5.0
    assert math.isfinite(float(ours[0].sum()))


@pytest.mark.parametrize(("max_batch_bytes", "calls"), [(None, 3), (2 * 16 * 32 * 4, 4)])
def test_muon_step_batches_and_matches_per_matrix_math(max_batch_bytes, calls):
    ns = RecordingNS()
    items = _items(SHAPES, 3, nesterov=lambda i: i != 1)
    expected = []
    for item in items:
        w, b = item.weight.clone(), item.buf.clone()
        x = torch.empty_like(b)
        momentum_update([b], [item.grad], [x], 0.9, item.nesterov)
        weight_decay_and_update([w], [ns.ns(x)], lr=0.1, weight_decay=0.2, scale=item.scale)
        expected.append((w, b))
    muon_step(items, ns, max_batch_bytes=max_batch_bytes)
    seen = [shape[0] for shape in ns.shapes]
    assert len(seen) == calls and sum(seen) == len(SHAPES)
    for (w, b), item in zip(expected, items):
        assert torch.equal(item.weight, w)
        assert torch.equal(item.buf, b)
