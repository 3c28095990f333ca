"""QK-clip: after a step with a zero learning rate (so that only the clip acts), the largest
logit of every head over the whole global batch, recomputed from the gathered weights by an
independent float64 reference on the hidden states the step measured, is at most τ; heads
(grouped-query: groups) that were above land on τ, and the rows of those that were not keep
every bit. On 2 and 4 gloo ranks, each rank training on its part of the batch: dedicated
weights on 1-D, HSDP (replicas stay bitwise equal to the owner), tensor parallelism, the
replicated (DDP) path (every rank's copy stays equal), and q/k weights left to FSDP2;
multi-head, grouped-query (with q/k biases) and an MLA-style row map. Also: a QK-norm
attention warns and is skipped, a training run whose logits run away without the clip stays
at τ with it, the argument checks, and on a CUDA device the same step without a host sync."""

from __future__ import annotations

import math
import warnings
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _attention import (
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    ROWS,
    VOCAB,
    ZERO_LR,
    ClipModel,
    attach,
    build,
    check_clip,
    explicit_max_logits,
    plain_copy,
    reference_max_logits,
    threshold,
    wrap,
)
from _models import batch
from torch import Tensor, nn

from dmuon_fsdp import (
    EMA,
    Muon,
    QKClip,
    QKRowMap,
    Role,
    get_model_state_dict,
    max_logits,
    max_logits_from_lse,
    max_logits_from_scores,
)
from dmuon_testing.distributed import run_distributed


def _zero_lr_step(path: str, kind: str, bias: bool, world_size: int) -> tuple[int, int]:
    tokens = batch(0, ROWS)
    initial = {k: v.clone() for k, v in build(kind, bias).state_dict().items()}
    before = reference_max_logits(build(kind, bias), tokens[:, :-1])
    tau = threshold(kind, before)
    model = build(kind, bias)
    runtime, dp_index, dp_size = wrap(model, path, world_size)
    clip = QKClip(tau=tau)
    attach(model, clip, kind)
    optimizer = Muon(model, **ZERO_LR)
    clip.attach(optimizer)
    local = tokens.chunk(dp_size)[dp_index]
    logits = model(local[:, :-1])
    F.cross_entropy(logits.reshape(-1, VOCAB), local[:, 1:].reshape(-1)).backward()
    optimizer.step()
    observed = clip.last_max_logits()
    state = get_model_state_dict(model)
    counts = check_clip(kind, bias, tau, before, observed, initial, state, tokens[:, :-1])
    if path == "hsdp":  # replicas hold the owner's weight, bit for bit
        replicas = [dp for dp in runtime.params if dp.role is Role.REPLICA]
        assert replicas
        for dp in replicas:
            assert torch.equal(dp.param.detach(), state[dp.fqn]), dp.fqn
    if path == "ddp":  # every rank's copy of every weight is the same
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), state[name]), name
    return counts


SCENARIOS = {
    2: [
        ("1d", "mha", False),
        ("1d", "gqa", True),
        ("1d", "mla", False),
        ("ddp", "gqa", True),
        ("fsdp", "mha", False),
        ("fsdp", "mla", False),
    ],
    4: [
        ("1d", "gqa", True),
        ("hsdp", "gqa", True),
        ("hsdp", "mla", False),
        ("ddp", "mha", False),
        ("tp", "mha", False),
        ("tp", "gqa", False),
        ("fsdp", "gqa", True),
    ],
}


def _all_scenarios(rank: int, world_size: int) -> dict[str, tuple[int, int]]:
    return {"/".join(map(str, s)): _zero_lr_step(*s, world_size) for s in SCENARIOS[world_size]}


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_zero_lr_step_clips_exactly_to_tau(world_size: int) -> None:
    results = run_distributed(_all_scenarios, world_size)
    for name, (clipped, untouched) in results[0].items():
        # Both kinds of group appear in every scenario, so neither check is vacuous.
        assert clipped > 0 and untouched > 0, name
    assert all(r == results[0] for r in results)


def _qk_norm_is_skipped(rank: int, world_size: int) -> dict[str, bool]:
    model = build("qknorm")
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    _, dp_index, dp_size = wrap(model, "1d", world_size)
    clip = QKClip(tau=1e-3)  # every head is far over τ
    attach(model, clip, "qknorm")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = Muon(model, **ZERO_LR)
        clip.attach(optimizer)
    messages = [w.filename for w in caught if "QK-norm" in str(w.message)]
    tokens = batch(0, ROWS).chunk(dp_size)[dp_index]

    def step() -> None:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()

    step()
    state = get_model_state_dict(model)
    recorded = bool((clip.last_max_logits() > 1e-3).all())
    # Forwards that observe nothing: warned once, at the line that stepped (a pre-step hook
    # warns, inside Muon.step and its hooks).
    for layer in model.layers:
        layer.attn.clip = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step()
        step()
    unobserved = [w.filename for w in caught if "no attention was observed" in str(w.message)]
    return {
        "warned for each attention, at attach's line": messages == [__file__] * 2,
        "unchanged": all(torch.equal(state[k], v) for k, v in initial.items()),
        "recorded": recorded,
        "unobserved warned once, at step's line": unobserved == [__file__],
    }


@pytest.mark.distributed
def test_qk_norm_attention_warns_and_is_skipped() -> None:
    for result in run_distributed(_qk_norm_is_skipped, 2):
        assert all(result.values()), result


def _undo_clip(state: dict[str, Tensor], peak: Tensor, tau: float) -> dict[str, Tensor]:
    """The weights before the clip of a multi-head attention step (α = 0.5): each head's q
    and k rows divided by √γ of the head."""
    undone = dict(state)
    gamma = torch.where(peak > tau, tau / peak.double(), torch.ones_like(peak, dtype=torch.float64))
    for layer in range(peak.shape[0]):
        for name in ("q_proj", "k_proj"):
            key = f"layers.{layer}.attn.{name}.weight"
            rows = gamma[layer].sqrt().repeat_interleave(HEAD_DIM)[:, None]
            undone[key] = state[key].double() / rows
    return undone


def _train(rank: int, world_size: int, tau: float, steps: int) -> dict[str, Any]:
    """Train a plain multi-head model on one fixed global batch at a high learning rate, with
    the clip at ``tau`` (``math.inf``: only record). Returns each step's global maxima and, with
    the clip, what the reference says about each step."""
    torch.manual_seed(1)
    model = ClipModel("mha")
    _, dp_index, dp_size = wrap(model, "1d", world_size)
    clip = QKClip(tau=tau)
    attach(model, clip, "mha")
    optimizer = Muon(model, lr=0.1, weight_decay=0.0, adamw_lr=1e-3)
    # The clip is part of the update, so an EMA averages the clipped weights whether it was
    # built before the attach or after it.
    emas = [EMA(optimizer, 0.5)]
    clip.attach(optimizer)
    emas.append(EMA(optimizer, 0.5))
    tokens = batch(0, ROWS)
    local = tokens.chunk(dp_size)[dp_index]
    peaks, landed, growth = [], [], []
    for _ in range(steps):
        optimizer.zero_grad()
        logits = model(local[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), local[:, 1:].reshape(-1)).backward()
        optimizer.step()
        peak = clip.last_max_logits()
        peaks.append(peak)
        if math.isinf(tau):
            continue
        # The clip scaled the logits of the data it measured by exactly γ: the weights before
        # the clip (the update done), read on the hidden states the clipped model computes,
        # give logits that γ turns into what the next forward observes.
        state = get_model_state_dict(model)
        clipped = plain_copy("mha", False, state)
        unclipped = plain_copy("mha", False, _undo_clip(state, peak, tau))
        before_clip = reference_max_logits(unclipped, tokens[:, :-1], clipped)
        now = reference_max_logits(clipped, tokens[:, :-1])
        gamma = torch.where(peak > tau, tau / peak.double(), 1.0)
        torch.testing.assert_close(now, before_clip * gamma, rtol=1e-4, atol=0)
        landed.append(now)
        # How much the update after the measurement raised each head's logits.
        growth.append(before_clip / peak.double())
    first, after = (ema.average for ema in emas)
    assert first.keys() == after.keys()
    assert all(torch.equal(first[name], after[name]) for name in first)
    return {"peaks": peaks, "landed": landed, "growth": growth}


def _train_both(rank: int, world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    return _train(rank, world_size, math.inf, TRAIN_STEPS), _train(
        rank, world_size, TAU, TRAIN_STEPS
    )


TAU, TRAIN_STEPS = 3.0, 10


@pytest.mark.distributed
def test_training_logits_run_away_without_the_clip_and_stay_at_tau_with_it() -> None:
    free, clipped = run_distributed(_train_both, 2)[0]
    free_peaks = [float(p.max()) for p in free["peaks"]]
    # Without the clip the largest logit passes τ within a few steps and keeps growing.
    first_over = next(i for i, p in enumerate(free_peaks) if p > TAU)
    assert first_over <= 5 and free_peaks[-1] > 2.5 * TAU, free_peaks
    # With it, a head over τ lands on τ and the next forward sees it grown by what one update
    # added after the measurement; a head under τ grows by that much too. So no head passes τ
    # times the growth of one update, and the logits stay near τ while they ran away without.
    engaged = 0
    for step, (now, growth) in enumerate(zip(clipped["landed"], clipped["growth"])):
        assert (clipped["peaks"][step] > 0).all()
        assert (now <= TAU * growth.clamp(min=1.0) * (1 + 1e-4)).all(), step
        engaged += int((clipped["peaks"][step] > TAU).sum())
    assert engaged > 0
    most = max(float(g.max()) for g in clipped["growth"])
    clipped_peaks = [float(p.max()) for p in clipped["peaks"]]
    assert max(clipped_peaks) <= TAU * most * (1 + 1e-4) < free_peaks[-1], (
        clipped_peaks,
        most,
        free_peaks,
    )


# -- configuration errors -----------------------------------------------------------------------


def test_row_maps_and_clips_validate_their_arguments() -> None:
    with pytest.raises(ValueError, match="unknown row kind"):
        QKRowMap((("v", 8),))
    with pytest.raises(ValueError, match="must be a positive int"):
        QKRowMap((("q", 0),))
    with pytest.raises(ValueError, match="has no 'q', 'k' or 'q_rope' rows"):
        QKRowMap((("skip", 8),))
    with pytest.raises(ValueError, match="smaller than one head's rows"):
        QKRowMap((("q", 8), ("q_rope", 4)), stride=10)
    with pytest.raises(ValueError, match="must be \\(kind, rows\\) pairs"):
        QKRowMap(("q", 8))  # type: ignore[arg-type]
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="tau must be > 0"):
            QKClip(tau=bad)
    with pytest.raises(ValueError, match="alpha must be in"):
        QKClip(alpha=1.5)
    clip = QKClip()
    with pytest.raises(ValueError, match="must be a multiple of num_kv_heads"):
        clip.add("a.q_proj.weight", "a.k_proj.weight", 4, 3)
    with pytest.raises(ValueError, match="is both the query and the key projection"):
        clip.add("a.qkv.weight", "a.qkv.weight", 4)
    clip.add("a.q_proj.weight", "a.k_proj.weight", 4, 2)
    with pytest.raises(ValueError, match="is already part of another attention"):
        clip.add("b.q_proj.weight", "a.k_proj.weight", 4)
    with pytest.raises(TypeError, match=r"must be a dmuon\.qk_clip\.QKRowMap"):
        clip.add("c.q_proj.weight", "c.k_proj.weight", 4, q_rows=(("q", 8),))  # type: ignore[arg-type]


def test_observe_records_the_maximum_of_training_forwards() -> None:
    clip = QKClip()
    clip.add("a.q_proj.weight", "a.k_proj.weight", 4)
    clip.add("b.q_proj.weight", "b.k_proj.weight", 2)
    clip.observe("a.q_proj.weight", torch.tensor([1.0, 5.0, -2.0, 0.0]))
    clip.observe("a.q_proj.weight", torch.tensor([2.0, 1.0, -3.0, 0.5]))  # a second micro-batch
    clip.observe("b.q_proj.weight", torch.tensor([7.0]), first_head=1)
    with torch.no_grad():  # evaluation: not recorded
        clip.observe("b.q_proj.weight", torch.tensor([9.0, 9.0]))
    clip.observe("b.q_proj.weight", torch.tensor([9.0, 9.0]), training=False)
    inf = math.inf
    want = torch.tensor([[2.0, 5.0, -2.0, 0.5], [-inf, 7.0, -inf, -inf]])
    assert torch.equal(clip._stats, want)
    with pytest.raises(ValueError, match="was not added"):
        clip.observe("c.q_proj.weight", torch.zeros(4))
    with pytest.raises(ValueError, match="max_logits has shape"):
        clip.observe("a.q_proj.weight", torch.zeros(3))
    with pytest.raises(ValueError, match="are not within the attention's"):
        clip.observe("a.q_proj.weight", torch.zeros(3), first_head=2)
    assert clip.names == ("a.q_proj.weight", "b.q_proj.weight")


class _Runtime:
    """The little of a runtime ``QKClip.bind`` reads before it touches a process group."""

    params: ClassVar[list[Any]] = []


def test_bind_checks_every_weight_against_the_model() -> None:
    model = ClipModel("mha")
    cases = [
        ((), "the QKClip has no attention"),
        ((("layers.0.attn.q.weight", "layers.0.attn.k_proj.weight", 4),), "is not a parameter"),
        ((("layers.0.attn.q_proj.weight", "layers.0.attn.k_proj.weight", 3),), "not a multiple"),
        ((("norm.weight", "layers.0.attn.k_proj.weight", 4),), "not a projection matrix"),
        (
            (
                (
                    "layers.0.attn.q_proj.weight",
                    "layers.0.attn.k_proj.weight",
                    4,
                    4,
                    QKRowMap((("q", 16),)),
                ),
            ),
            "needs 64 rows for 4 heads",
        ),
        (
            (
                (
                    "layers.0.attn.q_proj.weight",
                    "layers.0.attn.q_proj.weight",
                    2,
                    2,
                    QKRowMap((("q", 8),)),
                    QKRowMap((("k", 8),), start=8),
                ),
            ),
            "row maps of 'layers.0.attn.q_proj.weight' overlap",
        ),
    ]
    for attentions, message in cases:
        clip = QKClip()
        for q, k, heads, *rest in attentions:
            kv = rest[0] if rest else None
            maps = dict(zip(("q_rows", "k_rows"), rest[1:]))
            clip.add(q, k, heads, kv, **maps)
        with pytest.raises(ValueError, match=message):
            clip.bind(model, _Runtime())  # type: ignore[arg-type]
    # Grouped-query attention added without num_kv_heads: its key heads read as half their
    # size (half of each would be scaled); the message says which count to pass.
    clip = QKClip()
    clip.add("layers.0.attn.q_proj.weight", "layers.0.attn.k_proj.weight", HEADS)
    message = f"{HEAD_DIM} query rows per head.*{HEAD_DIM // 2} key rows.*num_kv_heads={KV_HEADS}"
    with pytest.raises(ValueError, match=message):
        clip.bind(ClipModel("gqa"), _Runtime())  # type: ignore[arg-type]
    # Qwen2.5-7B's counts (28 query heads of 8 rows here, 4 key heads): the key rows are not
    # even a multiple of 28, and the message still names the count to pass.
    qwen = nn.ModuleDict(
        {"attn": nn.ModuleDict({"q_proj": nn.Linear(8, 28 * 8), "k_proj": nn.Linear(8, 4 * 8)})}
    )
    clip = QKClip()
    clip.add("attn.q_proj.weight", "attn.k_proj.weight", 28)
    with pytest.raises(ValueError, match=r"not a multiple of its 28 heads.*num_kv_heads=4"):
        clip.bind(qwen, _Runtime())  # type: ignore[arg-type]
    model.layers[0].attn.k_proj.weight.requires_grad_(False)
    clip = QKClip()
    clip.add("layers.0.attn.q_proj.weight", "layers.0.attn.k_proj.weight", 4)
    with pytest.raises(ValueError, match="is frozen"):
        clip.bind(model, _Runtime())  # type: ignore[arg-type]


# -- on a CUDA device ---------------------------------------------------------------------------


def _no_host_sync(fn) -> Any:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


def _gpu_worker(rank: int, init_file: str) -> None:
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group(
        "nccl",
        init_method=f"file://{init_file}",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0),
    )
    try:
        device = torch.device("cuda", 0)
        # The three statistics on the device: exact, flex's max scores, the flash kernel's lse.
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(2, 4, 256, 64, device=device, generator=gen) * 4 for _ in range(3))
        exact = _no_host_sync(lambda: max_logits(q, k, is_causal=True))
        torch.testing.assert_close(
            exact.double().cpu(),
            explicit_max_logits(q.cpu(), k.cpu(), 64**-0.5, True, None),
            rtol=1e-5,
            atol=0,
        )
        causal = create_block_mask(lambda b, h, i, j: i >= j, None, None, 256, 256, device=device)
        _, aux = torch.compile(flex_attention)(
            q, k, v, block_mask=causal, return_aux=AuxRequest(max_scores=True)
        )
        torch.testing.assert_close(
            max_logits_from_scores(aux.max_scores), exact, rtol=1e-5, atol=1e-5
        )
        qb, kb, vb = (t.bfloat16() for t in (q, k, v))
        lse = torch.ops.aten._scaled_dot_product_flash_attention(qb, kb, vb, 0.0, True)[1]
        exact_bf16 = max_logits(qb, kb, is_causal=True)
        bound = max_logits_from_lse(lse)
        assert (bound >= exact_bf16 - 1e-3 * exact_bf16.abs()).all()
        assert (bound <= exact_bf16 + math.log(256) + 1e-2).all()

        # A zero-lr step clips on the device exactly as on the CPU; later steps make no host
        # sync, with QK-clip as without it (checked first, so that a failure says which).
        tokens = batch(0, ROWS)
        inputs, targets = tokens[:, :-1].to(device), tokens[:, 1:].reshape(-1).to(device)
        initial = {key: t.clone() for key, t in build("gqa", True).state_dict().items()}
        before = reference_max_logits(build("gqa", True), tokens[:, :-1])
        tau = threshold("gqa", before)
        for with_clip in (False, True):
            model = build("gqa", True).to(device)
            wrap(model, "1d", 1, "cuda")
            clip = QKClip(tau=tau)
            attach(model, clip, "gqa")
            optimizer = Muon(model, **ZERO_LR)
            if with_clip:
                clip.attach(optimizer)
            if not with_clip:
                for layer in model.layers:
                    layer.attn.clip = None
            for step in range(3):
                optimizer.zero_grad()
                F.cross_entropy(model(inputs).reshape(-1, VOCAB), targets).backward()
                if step > 0:
                    _no_host_sync(optimizer.step)
                    continue
                optimizer.step()
                if with_clip:
                    state = {key: t.cpu() for key, t in get_model_state_dict(model).items()}
                    observed = clip.last_max_logits()
                    check_clip("gqa", True, tau, before, observed, initial, state, tokens[:, :-1])
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_qk_clip_on_cuda_makes_no_host_sync() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import os
    import tempfile

    import torch.multiprocessing as mp

    tests_dir = os.path.dirname(__file__)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [
            tests_dir,
            os.path.join(tests_dir, "..", "..", "..", "testing"),
            os.environ.get("PYTHONPATH", ""),
        ]
    )
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_gpu_worker, args=(os.path.join(tmp, "init"),), nprocs=1)
