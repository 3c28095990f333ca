"""The demo's synthetic stream is deterministic, rank-sliceable and learnable; the model is a
causal Llama-style stack whose projection matrices are what the demo's predicate selects."""

from __future__ import annotations

import math

import pytest
import torch

from dmuon._demo_data import MarkovStream
from dmuon._demo_model import LlamaConfig, TinyLlama, muon_predicate, next_token_loss


def test_batches_are_a_pure_function_of_seed_and_step() -> None:
    a, b = MarkovStream(64, 16, seed=3), MarkovStream(64, 16, seed=3)
    assert torch.equal(a.batch(5, 8), b.batch(5, 8))
    assert torch.equal(a.batch(5, 8), a.batch(5, 8))  # no hidden state advances
    assert not torch.equal(a.batch(5, 8), a.batch(6, 8))
    assert not torch.equal(a.batch(5, 8), MarkovStream(64, 16, seed=4).batch(5, 8))
    x = a.batch(0, 8)
    assert x.shape == (8, 17) and x.dtype == torch.int64
    assert int(x.min()) >= 0 and int(x.max()) < 64


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_rank_shards_partition_the_global_batch(world_size: int) -> None:
    s = MarkovStream(64, 16, seed=1)
    parts = [s.shard(7, 8, r, world_size) for r in range(world_size)]
    assert torch.equal(torch.cat(parts), s.batch(7, 8))


def test_every_transition_is_one_of_the_allowed_successors() -> None:
    s = MarkovStream(64, 32, seed=0, branching=3)
    x = s.batch(0, 16)
    prev, nxt = x[:, :-1].flatten(), x[:, 1:].flatten()
    allowed = (s.successors[prev] == nxt[:, None]).any(dim=1)
    assert bool(allowed.all())
    assert torch.allclose(s.probs.sum(dim=1), torch.ones(64, dtype=torch.float64))


def test_stream_is_learnable_and_its_floor_is_right() -> None:
    """An independent learner (bigram counts fitted on training steps) gets close to the
    analytic floor on held-out steps, far below the uniform guess; the floor itself agrees
    with a Monte Carlo estimate under the true transition probabilities."""
    s = MarkovStream(64, 32, seed=0)
    counts = torch.ones(64, 64, dtype=torch.float64)  # add-one smoothing
    for step in range(40):
        x = s.batch(step, 32)
        counts.index_put_(
            (x[:, :-1].flatten(), x[:, 1:].flatten()),
            torch.ones(1, dtype=torch.float64),
            accumulate=True,
        )
    bigram = counts / counts.sum(dim=1, keepdim=True)
    held_out = torch.cat([s.batch(step, 32) for step in range(1000, 1010)])
    prev, nxt = held_out[:, :-1].flatten(), held_out[:, 1:].flatten()
    learned = float(-bigram[prev, nxt].log().mean())
    true = float(-s.transition_matrix()[prev, nxt].log().mean())
    floor = s.loss_floor()
    assert floor < 0.5 * s.uniform_loss
    assert abs(true - floor) < 0.05
    assert learned < floor + 0.25
    assert s.uniform_loss == pytest.approx(math.log(64))


def test_floor_propagates_as_the_dense_transition_matrix(monkeypatch: pytest.MonkeyPatch) -> None:
    """The floor's sparse propagation (successors only) equals the dense chain's: the entropy
    of each position's predecessor distribution, advanced by the transition matrix, which the
    floor never forms (20 GB at a vocabulary of 50257)."""
    s = MarkovStream(96, 12, seed=3, branching=5)
    p = s.transition_matrix()
    row_entropy = -(s.probs * s.probs.log()).sum(dim=1)
    dist = torch.full((96,), 1.0 / 96, dtype=torch.float64)
    total = 0.0
    for _ in range(12):
        total += float(dist @ row_entropy)
        dist = dist @ p

    def dense(self: MarkovStream) -> torch.Tensor:
        raise AssertionError("loss_floor formed the dense transition matrix")

    monkeypatch.setattr(MarkovStream, "transition_matrix", dense)
    assert s.loss_floor() == pytest.approx(total / 12, rel=1e-12, abs=0.0)


def test_bad_stream_arguments_raise() -> None:
    with pytest.raises(ValueError, match="vocab"):
        MarkovStream(1, 8)
    with pytest.raises(ValueError, match="branching"):
        MarkovStream(8, 8, branching=9)
    with pytest.raises(ValueError, match="divisible"):
        MarkovStream(8, 8).shard(0, 6, 0, 4)


def test_model_layout_and_causality() -> None:
    cfg = LlamaConfig(vocab=32, hidden=16, intermediate=24, layers=2, heads=2, seq_len=8)
    torch.manual_seed(0)
    model = TinyLlama(cfg)
    selected = [n for n, p in model.named_parameters() if muon_predicate(n, p)]
    projs = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert len(selected) == 7 * cfg.layers
    assert all(any(p in n for p in projs) and n.startswith("layers.") for n in selected)
    tokens = torch.randint(cfg.vocab, (2, cfg.seq_len))
    logits = model(tokens)
    assert logits.shape == (2, cfg.seq_len, cfg.vocab)
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % cfg.vocab
    # A change at the last position must not reach any earlier position.
    assert torch.equal(model(changed)[:, :-1], logits[:, :-1])
    # Untrained, the model is close to the uniform guess.
    loss = next_token_loss(model, torch.randint(cfg.vocab, (4, cfg.seq_len + 1)))
    assert abs(float(loss.detach()) - math.log(cfg.vocab)) < 0.2


def test_bad_model_config_raises() -> None:
    with pytest.raises(ValueError, match="divisible by heads"):
        LlamaConfig(hidden=30, heads=4)
    with pytest.raises(ValueError, match="even"):
        LlamaConfig(hidden=12, heads=4)
