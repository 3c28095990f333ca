"""clip_grad_norm_ and clip_grad_value_ for Muon grads (single process) and the strategy
registry."""

from __future__ import annotations

import math

import pytest
import torch
from _fake import FakeMuon, FakeMuonWithoutProbe
from _reference import assert_close, torch_clip

import dmuon_clip
from dmuon_clip import (
    MuonGradClipStats,
    clip_grad_norm_,
    clip_grad_value_,
    clip_grads_with_norm_,
    register_muon_grad_clip_strategy,
    registered_muon_grad_clip_strategies,
    try_clip_optimizer_grad_norm_buckets_,
    unregister_muon_grad_clip_strategy,
)

RTOL = 1e-6  # a few fp32 ulps: a different summation order than torch's


def _matrices(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(m, n, generator=gen) for m, n in [(8, 4), (16, 16), (3, 12)]]


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.3, 100.0, None])
def test_global_norm_matches_torch(norm_type: float, max_norm: float | None) -> None:
    grads = _matrices()
    total, ref = torch_clip(grads, max_norm, norm_type)
    before = [g.clone() for g in grads]
    opt = FakeMuon(grads)
    stats = clip_grad_norm_(opt, max_norm, norm_type)
    assert opt.calls == 1
    assert isinstance(stats, MuonGradClipStats) and stats.param_count == 3
    assert_close(stats.total_norm, total, rtol=RTOL)
    assert stats.total_norm.dtype == torch.float32 and stats.clipped.dtype == torch.bool
    expected = before if max_norm is None else ref
    for got, want in zip(grads, expected):
        assert_close(got, want, rtol=RTOL)
    assert bool(stats.clipped) == (max_norm is not None and float(total) > max_norm)
    # torch's clip returns the total norm alone: its habits are pointed at the field.
    for habit in ("item", "full_tensor"):
        with pytest.raises(
            AttributeError, match=rf"no '{habit}': .* the norm is stats\.total_norm"
        ):
            getattr(stats, habit)
    assert not hasattr(stats, "no_such_field") and not hasattr(stats, "__array__")


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_measure_then_clip_with_the_norm_as_torch_splits_it(norm_type: float) -> None:
    # torch: get_total_norm, then clip_grads_with_norm_ (a norm combined over pipeline
    # stages, say); dmuon: clip_grad_norm_ with max_norm=None, then clip_grads_with_norm_.
    grads = _matrices()
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, 0.3, total)
    copy = grads[1].clone()  # another rank counts it: scaled alike
    optimizer = FakeMuon(grads, copies=(copy,))
    measured = clip_grad_norm_(optimizer, None, norm_type).total_norm
    assert_close(measured, total, rtol=RTOL)
    clip_grads_with_norm_(optimizer, 0.3, measured)
    for got, p in zip(grads, params, strict=True):
        assert_close(got, p.grad, rtol=RTOL)
    assert torch.equal(copy, grads[1])
    before = [g.clone() for g in grads]
    for max_norm, norm, error, match in (
        (None, 1.0, ValueError, "measure with clip_grad_norm_"),
        (-1.0, 1.0, ValueError, "max_norm must be a number >= 0"),
        (0.3, "1.0", TypeError, "total_norm must be a number or a one-element tensor"),
        (0.3, torch.ones(2), TypeError, "total_norm must be a number or a one-element tensor"),
    ):
        with pytest.raises(error, match=match):
            clip_grads_with_norm_(optimizer, max_norm, norm)  # type: ignore[arg-type]
    clip_grads_with_norm_(optimizer, 0.3, torch.tensor(math.nan))  # never scaled by a NaN
    assert all(torch.equal(a, b) for a, b in zip(grads, before, strict=True))
    # max_norm=inf is torch's "do not clip": its coefficient clamps to 1, so nothing is scaled
    # (it raised 'must be a finite number'), and clip_grad_norm_ measures as with None.
    clip_grads_with_norm_(optimizer, math.inf, measured)
    stats = clip_grad_norm_(optimizer, math.inf, norm_type)
    assert all(torch.equal(a, b) for a, b in zip(grads, before, strict=True))
    assert not bool(stats.clipped) and float(stats.clip_coef) == 1.0
    assert torch.equal(stats.total_norm, clip_grad_norm_(optimizer, None, norm_type).total_norm)


def test_nonfinite_is_reported_not_applied_and_can_raise() -> None:
    grads = _matrices()
    grads[1][0, 0] = math.nan
    before = [g.clone() for g in grads]
    stats = clip_grad_norm_(FakeMuon(grads), 1.0)
    assert bool(stats.found_inf) and not bool(stats.clipped) and float(stats.clip_coef) == 1.0
    for got, old in zip(grads, before):
        assert_close(got, old, rtol=0, equal_nan=True)
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(FakeMuon(grads), 1.0, error_if_nonfinite=True)
    for got, old in zip(grads, before):
        assert_close(got, old, rtol=0, equal_nan=True)


def test_error_if_nonfinite_must_be_a_bool() -> None:
    grads = _matrices()
    before = [g.clone() for g in grads]
    with pytest.raises(TypeError, match="error_if_nonfinite must be a bool, got 'no'"):
        clip_grad_norm_(FakeMuon(grads), 0.1, error_if_nonfinite="no")  # type: ignore[arg-type]
    assert all(torch.equal(g, b) for g, b in zip(grads, before))


def test_no_owned_grads() -> None:
    stats = clip_grad_norm_(FakeMuon([]), 1.0)
    assert float(stats.total_norm) == 0.0 and stats.param_count == 0
    assert float(stats.clip_coef) == 1.0 and not bool(stats.clipped)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_per_matrix_strategy_clips_each_matrix_alone(norm_type: float) -> None:
    grads = _matrices(1)
    grads[0].mul_(0.01)  # below the threshold: left alone
    refs = [torch_clip([g], 1.0, norm_type) for g in grads]
    stats = clip_grad_norm_(FakeMuon(grads), 1.0, norm_type, strategy="per_matrix")
    for got, (_, ref) in zip(grads, refs):
        assert_close(got, ref[0], rtol=RTOL)
    assert bool(stats.clipped) and not bool(stats.found_inf)
    smallest = min(min(1.0, 1.0 / (float(t) + 1e-6)) for t, _ in refs)
    assert float(stats.clip_coef) == pytest.approx(smallest, rel=RTOL)


def test_per_matrix_strategy_leaves_a_nonfinite_matrix_alone() -> None:
    grads = _matrices(2)
    grads[2][1, 1] = math.inf
    bad_before = grads[2].clone()
    _, ref = torch_clip([grads[0]], 0.5)
    stats = clip_grad_norm_(FakeMuon(grads), 0.5, strategy="per_matrix")
    assert bool(stats.found_inf) and bool(stats.clipped)
    assert torch.equal(grads[2], bad_before)
    assert_close(grads[0], ref[0], rtol=RTOL)


def test_per_matrix_strategy_clips_each_matrix_of_a_stack_alone() -> None:
    # An expert stack (experts, rows, cols) is a batch of matrices: each takes its own
    # coefficient, whatever share of the stack a rank holds.
    gen = torch.Generator().manual_seed(5)
    stack = torch.randn(4, 6, 5, generator=gen)
    stack[1].mul_(100.0)  # one expert far above max_norm, the others below it
    stack[3, 0, 0] = math.inf  # a non-finite expert: left as it is
    want = [torch_clip([m.clone()], 2.0)[1][0] for m in stack]
    want[3] = stack[3].clone()
    whole, halves = stack.clone(), [stack[:1].clone(), stack[1:].clone()]
    stats = clip_grad_norm_(FakeMuon([whole]), 2.0, strategy="per_matrix")
    clip_grad_norm_(FakeMuon(halves), 2.0, strategy="per_matrix")
    assert bool(stats.found_inf) and bool(stats.clipped)
    for i, expert in enumerate(want):
        assert_close(whole[i], expert, rtol=RTOL, equal_nan=True)
    assert torch.equal(torch.cat(halves), whole)
    assert float(stats.clip_coef) == pytest.approx(2.0 / (float(stack[1].norm()) + 1e-6), rel=RTOL)


def test_per_matrix_strategy_takes_fp64_gradients() -> None:
    grads = [g.double() for g in _matrices(8)]
    refs = [torch_clip([g.clone()], 0.5)[1][0] for g in grads]
    stats = clip_grad_norm_(FakeMuon(grads), 0.5, strategy="per_matrix")
    assert stats.total_norm.dtype == torch.float32 and bool(stats.clipped)
    for got, want in zip(grads, refs):
        assert_close(got, want, rtol=RTOL)


def test_per_matrix_strategy_clips_a_copy_by_its_own_norms() -> None:
    # A copy (a stack shard another replica counts) must end as the counted original does
    # there, not take this rank's smallest coefficient.
    grads = _matrices(6)
    grads[0].mul_(0.01)
    copy = torch.randn(3, 7, 7, generator=torch.Generator().manual_seed(7))
    counted = copy.clone()
    clip_grad_norm_(FakeMuon([counted]), 1.0, strategy="per_matrix")
    stats = clip_grad_norm_(FakeMuon(grads, copies=(copy,)), 1.0, strategy="per_matrix")
    assert stats.param_count == 4
    assert torch.equal(copy, counted)


@pytest.mark.parametrize("max_norm", [0.3, None])
def test_copies_take_the_coefficient_but_not_the_norm(max_norm: float | None) -> None:
    # Under tensor parallelism a whole matrix that every TP grid keeps is counted by one rank;
    # the others hand it over as a copy: scaled like the rest, never counted.
    grads = _matrices(3)
    copy = _matrices(3)[1]
    copy_before = copy.clone()
    total, ref = torch_clip(grads, max_norm)
    stats = clip_grad_norm_(FakeMuon(grads, copies=(copy,)), max_norm)
    assert_close(stats.total_norm, total, rtol=RTOL)
    assert stats.param_count == 4
    if max_norm is None:
        assert torch.equal(copy, copy_before)
    else:
        assert bool(stats.clipped)
        assert torch.equal(copy, copy_before * stats.clip_coef)
        assert_close(copy, ref[1], rtol=RTOL)  # the counted original, clipped the same way


def test_per_matrix_is_refused_under_tensor_parallelism() -> None:
    grads = _matrices(4)
    before = [g.clone() for g in grads]
    opt = FakeMuon(grads, sharded=True)
    with pytest.raises(ValueError, match="strategy='per_matrix' clips each tensor by the norm"):
        clip_grad_norm_(opt, 0.1, strategy="per_matrix")
    assert all(torch.equal(g, b) for g, b in zip(grads, before))
    total, ref = torch_clip(grads, 0.1)
    assert_close(clip_grad_norm_(opt, 0.1).total_norm, total, rtol=RTOL)
    for got, want in zip(grads, ref):
        assert_close(got, want, rtol=RTOL)


def test_per_matrix_is_refused_before_the_gradients_are_taken() -> None:
    # An optimizer that answers grads_split_over_ranks is asked first: taking its gradients
    # has an effect (dmuon's turns ns_overlap off), which a refused call must not have.
    # The refusal names the parameter the optimizer says is split, when it can say.
    class Probed(FakeMuon):
        def grads_split_over_ranks(self, params: object) -> bool:
            return params == "all"

        def param_split_over_ranks(self, params: object) -> str | None:
            return "embed.weight" if params == "all" else None

        def grads_for_clip(self, params: object) -> object:
            return self.muon_grads_for_clip()

    opt = Probed(_matrices(2))
    with pytest.raises(
        ValueError,
        match=r"strategy='per_matrix' clips each tensor by the norm .* a shard of the gradient"
        r" of 'embed\.weight' \(a tensor-parallel matrix, .*strategy='global_norm'",
    ):
        clip_grad_norm_(opt, 0.1, strategy="per_matrix", params="all")
    assert opt.calls == 0
    clip_grad_norm_(opt, 0.1, strategy="per_matrix")
    assert opt.calls == 1


def test_registry() -> None:
    assert {"global_norm", "per_matrix"} <= set(registered_muon_grad_clip_strategies())
    with pytest.raises(ValueError, match=r"unknown Muon grad clip strategy 'nope'.*global_norm"):
        clip_grad_norm_(FakeMuon(_matrices()), 1.0, strategy="nope")
    with pytest.raises(ValueError, match="already registered; pass overwrite=True"):
        register_muon_grad_clip_strategy("global_norm", lambda *a: None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be callable"):
        register_muon_grad_clip_strategy("x", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no Muon grad clip strategy named 'never'"):
        unregister_muon_grad_clip_strategy("never")

    seen = []

    def halve(grads, max_norm, norm_type, process_group, device):
        seen.append((len(grads), max_norm, norm_type, process_group, device))
        torch._foreach_mul_(grads, 0.5)
        z = torch.zeros((), device=device)
        return MuonGradClipStats(z, z + 0.5, z.bool() | True, z.bool(), len(grads))

    register_muon_grad_clip_strategy("halve", halve)
    try:
        grads = _matrices()
        before = [g.clone() for g in grads]
        stats = clip_grad_norm_(FakeMuon(grads, device="cpu"), 2.0, 3.0, strategy="halve")
        assert seen == [(3, 2.0, 3.0, None, torch.device("cpu"))]
        assert float(stats.clip_coef) == 0.5
        assert all(torch.equal(g, b * 0.5) for g, b in zip(grads, before))
        with pytest.raises(ValueError, match="already registered"):
            register_muon_grad_clip_strategy("halve", halve)
        register_muon_grad_clip_strategy("halve", halve, overwrite=True)
    finally:
        unregister_muon_grad_clip_strategy("halve")
    assert "halve" not in registered_muon_grad_clip_strategies()

    register_muon_grad_clip_strategy("nothing", lambda *args: None)  # type: ignore[arg-type]
    try:
        with pytest.raises(TypeError, match="'nothing' returned NoneType; a strategy returns"):
            clip_grad_norm_(FakeMuon(_matrices()), 1.0, strategy="nothing")
    finally:
        unregister_muon_grad_clip_strategy("nothing")


def test_a_registered_per_matrix_strategy_clips_copies_alone_and_is_refused_under_tp() -> None:
    # A strategy of one coefficient per matrix, registered as such: a copy is clipped by
    # calling it on the copies (not by this rank's clip_coef), and tensor parallelism refuses it.
    def by_own_norm(grads, max_norm, norm_type, process_group, device):
        coefs = [min(max_norm / (float(g.norm()) + 1e-6), 1.0) for g in grads]
        for g, c in zip(grads, coefs):
            g.mul_(c)
        z = torch.zeros((), device=device)
        return MuonGradClipStats(z, z + min(coefs), z.bool() | True, z.bool(), len(grads))

    register_muon_grad_clip_strategy("own", by_own_norm, per_matrix=True)
    try:
        grads = _matrices(2)
        grads[0].mul_(0.01)  # this rank's smallest coefficient is near 1
        copy = 10 * torch.randn(7, 7, generator=torch.Generator().manual_seed(3))
        expected = copy * min(1.0 / (float(copy.norm()) + 1e-6), 1.0)
        clip_grad_norm_(FakeMuon(grads, copies=(copy,)), 1.0, strategy="own")
        assert torch.equal(copy, expected)
        with pytest.raises(ValueError, match="strategy='own' clips each tensor by the norm"):
            clip_grad_norm_(FakeMuon(_matrices(), sharded=True), 1.0, strategy="own")
        with pytest.raises(TypeError, match="per_matrix must be a bool"):
            register_muon_grad_clip_strategy("own", by_own_norm, overwrite=True, per_matrix=1)  # type: ignore[arg-type]
    finally:
        unregister_muon_grad_clip_strategy("own")


def test_optimizer_without_the_protocol() -> None:
    class PlainOptimizer:  # e.g. a torch.optim optimizer: no dmuon protocol
        def step(self) -> None: ...

    opt = PlainOptimizer()
    with pytest.raises(TypeError, match=r"torch\.nn\.utils\.clip_grad_norm_"):
        clip_grad_norm_(opt, 1.0)  # type: ignore[arg-type]
    # torch's habit, the parameters first: the fix is dmuon's call (torch's clip would miss the
    # dedicated matrices' gradients on a model with dmuon), for the value clip too.
    grads = _matrices()
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for first in (params, iter(params), params[0]):
        with pytest.raises(TypeError, match=r"takes dmuon's Muon optimizer first, not the param"):
            clip_grad_norm_(first, 1.0)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"dmuon\.clip\.clip_grad_value_\(optimizer, \.\.\."):
            clip_grad_value_(first, 1.0)  # type: ignore[arg-type]


def test_clip_grad_value_clamps_grads_and_copies_as_torch_does() -> None:
    grads, copies = _matrices(0), tuple(_matrices(1)[:1])
    grads[1][0, 0] = math.nan  # stays NaN, as in torch
    references = [torch.nn.Parameter(torch.zeros_like(g)) for g in [*grads, *copies]]
    for p, g in zip(references, [*grads, *copies], strict=True):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_value_(references, 0.5)
    clip_grad_value_(FakeMuon(grads, copies=copies), 0.5)
    for got, ref in zip([*grads, *copies], references, strict=True):
        assert torch.equal(got.nan_to_num(7.0), ref.grad.nan_to_num(7.0))
    assert math.isnan(grads[1][0, 0])
    assert 0.0 < max(float(g.abs().max()) for g in _matrices(0)) - 0.5  # something was clamped


@pytest.mark.parametrize("bad", [-1.0, math.nan])
def test_clip_grad_value_refuses_a_value_it_cannot_clamp_to(bad: float) -> None:
    grads = _matrices()
    before = [g.clone() for g in grads]
    with pytest.raises(ValueError, match="clip_value must be a number >= 0"):
        clip_grad_value_(FakeMuon(grads), bad)
    # inf clamps nothing, as torch's clip_grad_value_ (it raised 'must be a finite number'),
    # and takes nothing (dmuon's Muon turns ns_overlap off when its gradients are taken).
    optimizer = FakeMuon(grads)
    clip_grad_value_(optimizer, math.inf)
    assert optimizer.calls == 0
    with pytest.raises(TypeError, match="clip_value must be a number, got True"):
        clip_grad_value_(FakeMuon(grads), True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"torch\.nn\.utils\.clip_grad_value_"):
        clip_grad_value_(object(), 1.0)  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(grads, before, strict=True))


@pytest.mark.parametrize("probe", [True, False])
@pytest.mark.parametrize("grouped", [False, True])
def test_try_clip_returns_none_on_cpu_and_touches_nothing(monkeypatch, probe, grouped) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    muon = _matrices(0)
    regular, adamw = _matrices(1), _matrices(2)
    before = [g.clone() for g in [*muon, *regular, *adamw]]
    group = object() if grouped else None  # the Muon group, passed as process_group too
    optimizer = (FakeMuon if probe else FakeMuonWithoutProbe)(muon, process_group=group)
    result = try_clip_optimizer_grad_norm_buckets_(
        optimizer, regular_grads=regular, adamw_grads=adamw, max_norm=0.1, process_group=group
    )
    assert result is None
    assert all(torch.equal(a, b) for a, b in zip([*muon, *regular, *adamw], before))
    # Nothing taken (dmuon's Muon turns ns_overlap off when its gradients are taken) ...
    assert optimizer.calls == 0
    # ... and bad input raises here as where the fast path runs (it returned None unread).
    for max_norm, match in (
        (-1.0, "max_norm must be a number >= 0"),
        ({"muon": 1.0}, r"needs exactly one entry per bucket; missing \['regular', 'adamw'\]"),
    ):
        with pytest.raises(ValueError, match=match):
            try_clip_optimizer_grad_norm_buckets_(
                optimizer, regular_grads=regular, adamw_grads=adamw, max_norm=max_norm
            )
    assert optimizer.calls == 0


@pytest.mark.parametrize("kernels_may_run", [False, True])
def test_try_clip_refuses_an_optimizer_without_the_protocol(monkeypatch, kernels_may_run) -> None:
    # accelerate's AcceleratedOptimizer around dmuon's Muon has no muon_grads_for_clip(): the
    # call returned None in a process without CUDA or the interpreter (as if the fast path
    # were merely unavailable) and raised AttributeError where the kernels may run.
    reason = None if kernels_may_run else "neither CUDA nor the Triton interpreter"
    monkeypatch.setattr(dmuon_clip._fastpath, "unavailable_in_process", lambda: reason)
    regular = _matrices(1)
    before = [g.clone() for g in regular]
    with pytest.raises(TypeError, match=r"has no muon_grads_for_clip\(\).*its \.optimizer"):
        try_clip_optimizer_grad_norm_buckets_(
            object(),  # type: ignore[arg-type]
            regular_grads=regular,
            adamw_grads=[],
            max_norm=0.1,
        )
    assert all(torch.equal(a, b) for a, b in zip(regular, before, strict=True))


def test_try_clip_group_mismatch_is_an_error() -> None:
    # Raised before the Muon gradients are taken, whether the fast path runs or not.
    optimizer = FakeMuon([], process_group=object())
    with pytest.raises(ValueError, match="process_group must be None or the group"):
        try_clip_optimizer_grad_norm_buckets_(
            optimizer, regular_grads=[], adamw_grads=[], max_norm=1.0, process_group=object()
        )
    assert optimizer.calls == 0


def test_public_surface() -> None:
    for name in dmuon_clip.__all__:
        assert hasattr(dmuon_clip, name), name
