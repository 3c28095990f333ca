"""dmuon.clip_grad_norm_ against the real dmuon.Muon: the Muon-grad norm over owners equals the
norm of the full-batch gradients of the same matrices in one process, and clipping scales what
the next step reads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dmuon._demo_model import LlamaConfig, TinyLlama, muon_predicate
from dmuon_testing.distributed import run_distributed

CFG = LlamaConfig(vocab=64, hidden=32, intermediate=64, layers=2, heads=2, seq_len=8)
ROWS = 8  # global batch, split evenly over ranks


def _tokens() -> torch.Tensor:
    return torch.randint(
        0, CFG.vocab, (ROWS, CFG.seq_len), generator=torch.Generator().manual_seed(1)
    )


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, CFG.vocab), tokens[:, 1:].reshape(-1))


def _reference_muon_norm() -> float:
    torch.manual_seed(0)
    model = TinyLlama(CFG)
    _loss(model, _tokens()).backward()
    grads = [p.grad for n, p in model.named_parameters() if muon_predicate(n, p)]
    return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()


def _clip_on_ranks(rank: int, world_size: int, max_norm: float) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    torch.manual_seed(0)
    model = TinyLlama(CFG)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
    dmuon.dedicate_params(model, mesh, muon_predicate)
    dedicated = dmuon.dedicated_params_of(model)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=dedicated)
    fully_shard(model, mesh=mesh, ignored_params=dedicated)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)

    rows = ROWS // world_size
    _loss(model, _tokens()[rank * rows : (rank + 1) * rows]).backward()
    before = [g.clone() for g in optimizer.muon_grads_for_clip().grads]
    stats = dmuon.clip_grad_norm_(optimizer, max_norm)
    after = optimizer.muon_grads_for_clip().grads
    ratios = [(a.norm() / b.norm()).item() for a, b in zip(after, before)]
    optimizer.step()  # the step consumes the clipped grads without error
    return {
        "total_norm": stats.total_norm.item(),
        "clip_coef": stats.clip_coef.item(),
        "owned": len(before),
        "ratios": ratios,
    }


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [4])
def test_muon_norm_over_owners_equals_full_batch_norm(world_size: int) -> None:
    expected = _reference_muon_norm()
    max_norm = expected / 4  # forces clipping
    results = run_distributed(_clip_on_ranks, world_size, max_norm)

    n_matrices = 7 * CFG.layers
    assert sum(r["owned"] for r in results) == n_matrices  # each matrix on exactly one owner
    for r in results:
        assert r["total_norm"] == pytest.approx(expected, rel=1e-5)
        assert r["clip_coef"] == pytest.approx(max_norm / (expected + 1e-6), rel=1e-5)
        for ratio in r["ratios"]:
            assert ratio == pytest.approx(r["clip_coef"], rel=1e-5)
