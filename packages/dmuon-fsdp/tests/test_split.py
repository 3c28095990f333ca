"""A fused projection with a declared split trains as the model with separate modules does,
bit for bit (see [Note: declared splits] in dmuon_ownership).

A tiny grouped-query attention model (4 query heads, 2 key/value heads, head_dim 4, hidden 16)
is built three ways from the same initial values: one fused ``[q; k; v]`` weight ``(32, 16)``,
separate q/k/v weights ``(16, 16)``, ``(8, 16)``, ``(8, 16)``, and one weight per head
``(4, 16)``. On two gloo ranks, the fused model with ``MatrixSplit(heads=4, kv_heads=2)`` (the
predicate's result) trains bit for bit as the q/k/v model, and with ``per_head=True`` (a
``param_policy`` rule) as the per-head model: every loss and every final weight (the fused
rows sliced). The owners, the NS batches and their composition differ between the models; the
planner charges each split weight its pieces' cost, and the step profile's NS calls have the
pieces' shapes. Without a split the fused model trains otherwise (the check can fail).

Every layout computes its projection as one product with its weights' rows concatenated, so
that forward and backward are the same operations in all three and the comparison isolates
the optimizer: with one product per module, the gradient of the projection's input would sum
the modules' parts in another order than the fused product does (other rounding, whatever the
optimizer).
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _models import shard_layers_then_root
from _reference import Hyper, lm_loss, make_batch, shard
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dmuon_fsdp import (
    MatrixSplit,
    Muon,
    StepOptions,
    dedicate_params,
    get_model_state_dict,
    summarize_param_groups,
)
from dmuon_ownership import ns_cost
from dmuon_testing.distributed import run_distributed
from dmuon_testing.typed_dicts import check_returns

VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM = 32, 16, 4, 2, 4
Q, KV = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM  # 16 and 8 rows
LAYOUTS = {"fused": [Q + 2 * KV], "qkv": [Q, KV, KV], "heads": [HEAD_DIM] * (HEADS + 2 * KV_HEADS)}
HYPER = Hyper()
STEPS = 3
QKV_SPLIT = MatrixSplit(heads=HEADS, kv_heads=KV_HEADS)
PER_HEAD = {"heads": HEADS, "kv_heads": KV_HEADS, "per_head": True}  # a JSON-like policy rule


class Block(nn.Module):
    """Attention whose q, k and v rows come from ``proj`` (one fused weight, three, or one per
    head, concatenated in that order) and a small MLP."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        self.proj = nn.ParameterList(
            nn.Parameter(torch.randn(n, DIM) * DIM**-0.5) for n in LAYOUTS[layout]
        )
        self.o_proj = nn.Linear(Q, DIM, bias=False)
        self.up_proj = nn.Linear(DIM, 2 * DIM, bias=False)
        self.down_proj = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        # One product with the rows of every layout's weights (see the module's docstring).
        weight = torch.cat(list(self.proj))
        qkv = F.linear(F.rms_norm(x, (DIM,)), weight)
        q, k, v = (
            y.view(b, t, -1, HEAD_DIM).transpose(1, 2) for y in qkv.split([Q, KV, KV], dim=-1)
        )
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(att.transpose(1, 2).reshape(b, t, Q))
        return x + self.down_proj(F.silu(self.up_proj(F.rms_norm(x, (DIM,)))))


class Model(nn.Module):
    def __init__(self, layout: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(layout) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build(layout: str) -> Model:
    """The model in ``layout`` with the values of the seeded fused one (its fused weights cut
    into rows)."""
    torch.manual_seed(0)
    values = Model("fused").state_dict()
    model = Model(layout)
    state = {}
    for key, value in values.items():
        if not key.endswith(".proj.0"):
            state[key] = value
            continue
        for i, rows in enumerate(value.split(LAYOUTS[layout])):
            state[f"{key[:-1]}{i}"] = rows.clone()
    model.load_state_dict(state)
    return model


def _muon(name: str, p: nn.Parameter) -> bool:
    return name.startswith("layers.") and p.ndim == 2


def _train(layout: str, predicate: Any, policy: Any = None) -> dict[str, Any]:
    """Train ``layout`` for STEPS steps on this rank; what the test compares."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build(layout)
    mesh = init_device_mesh("cpu", (world_size,))
    runtime = dedicate_params(model, mesh, predicate, param_policy=policy, small_param_threshold=0)
    shard_layers_then_root(model, mesh)
    optimizer = Muon(model, **HYPER.muon_kwargs(), options=StepOptions(profile=True))
    losses, ns_shapes = [], set()
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = lm_loss(model, shard(make_batch(step, 8, 8, VOCAB), rank, world_size))
        loss.backward()
        optimizer.step()
        ns_shapes |= {
            tuple(int(d) for d in m.group(1).split("x")[1:])
            for phase in optimizer.step_profile()
            if (m := re.fullmatch(r"ns\[([\dx]+)\]", phase))
        }
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    groups = summarize_param_groups(model, optimizer)
    check_returns(summarize_param_groups, groups)  # a declared split's pieces too
    rows = {row["name"]: row["matrices"] for group in groups for row in group["rows"]}
    return {
        "losses": losses,
        "weights": get_model_state_dict(model),
        "ns_shapes": ns_shapes,
        "owners": {dp.fqn: tuple(dp.owner) for dp in runtime.params},
        "loads": runtime.plan.loads,
        "matrices": rows["layers.0.proj.0"],
    }


def _refuse_tensor_parallel(world_size: int) -> None:
    """A split of a matrix sharded over TP ranks is refused before anything is set up."""
    model = build("fused")
    tp_mesh = init_device_mesh("cpu", (world_size,))
    block = model.layers[0]
    block.proj[0] = nn.Parameter(distribute_tensor(block.proj[0].detach(), tp_mesh, [Shard(0)]))
    with pytest.raises(
        ValueError,
        match=r"'layers\.0\.proj\.0' has a declared split .* it is a tensor-parallel matrix",
    ):
        dedicate_params(model, tp_mesh, lambda n, p: QKV_SPLIT if n.endswith("proj.0") else False)


def _runs(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    fused = "layers.0.proj.0", "layers.1.proj.0"

    def split_qkv(name: str, p: nn.Parameter) -> bool | MatrixSplit:
        return QKV_SPLIT if name in fused else _muon(name, p)

    per_head = {"overrides": [{"name": ["proj.0"], "set": {"split": PER_HEAD}}]}
    _refuse_tensor_parallel(world_size)
    return {
        "split": _train("fused", split_qkv),
        "qkv": _train("qkv", _muon),
        "per_head": _train("fused", _muon, per_head),
        "heads": _train("heads", _muon),
        "joint": _train("fused", _muon),
    }


def _pieces(weights: dict[str, Tensor], layout: str) -> dict[str, Tensor]:
    """Every weight with each layer's q/k/v rows as the fused layout holds them."""
    out = {k: v for k, v in weights.items() if ".proj." not in k}
    for layer in range(2):
        prefix = f"layers.{layer}.proj"
        out[f"{prefix}.0"] = torch.cat(
            [weights[f"{prefix}.{i}"] for i in range(len(LAYOUTS[layout]))]
        )
    return out


@pytest.mark.distributed
def test_a_split_fused_projection_trains_as_separate_modules_bit_for_bit() -> None:
    results = run_distributed(_runs, 2)
    mine = results[0]
    for name, reference in (("split", "qkv"), ("per_head", "heads")):
        got, want = mine[name], mine[reference]
        assert got["losses"] == want["losses"], name
        assert all(math.isfinite(x) for x in got["losses"]) and got["losses"][-1] < got["losses"][0]
        expected = _pieces(want["weights"], reference)
        assert got["weights"].keys() == expected.keys()
        for key, value in got["weights"].items():
            assert torch.equal(value, expected[key]), f"{name}: {key}"
        # The NS calls over both ranks: the pieces' shapes, as the separate weights'.
        shapes = [set().union(*(r[run]["ns_shapes"] for r in results)) for run in (name, reference)]
        assert shapes[0] == shapes[1]
    # The owners and the batches differ between the two models, the bits do not: the fused
    # weight has one owner, the separate q, k and v of its layer two.
    owners = mine["qkv"]["owners"]
    assert len({owners[f"layers.0.proj.{i}"] for i in range(3)}) == 2
    assert (Q + 2 * KV, DIM) in set().union(*(r["joint"]["ns_shapes"] for r in results))
    assert (HEAD_DIM, DIM) in set().union(*(r["per_head"]["ns_shapes"] for r in results))
    # Without a split the fused model orthogonalises [q; k; v] as one matrix: other weights.
    assert mine["joint"]["losses"][:1] == mine["qkv"]["losses"][:1]
    assert mine["joint"]["losses"][-1] != mine["qkv"]["losses"][-1]
    # The planner charges a split weight its pieces' NS work: the same total as the separate
    # weights', less than the fused matrix's.
    total = {run: math.fsum(mine[run]["loads"]) for run in ("split", "qkv", "joint")}
    assert total["split"] == total["qkv"] < total["joint"]
    assert total["joint"] - total["qkv"] == 2 * (
        ns_cost((Q + 2 * KV, DIM)) - ns_cost((Q, DIM)) - 2 * ns_cost((KV, DIM))
    )
    assert mine["split"]["matrices"]["pieces"] == [
        {"name": "q", "rows": [0, Q], "count": 1, "shape": [Q, DIM]},
        {"name": "k", "rows": [Q, Q + KV], "count": 1, "shape": [KV, DIM]},
        {"name": "v", "rows": [Q + KV, Q + 2 * KV], "count": 1, "shape": [KV, DIM]},
    ]
    per_head = mine["per_head"]["matrices"]
    assert (per_head["count"], per_head["shape"]) == (HEADS + 2 * KV_HEADS, [HEAD_DIM, DIM])
    assert mine["joint"]["matrices"] == {
        "count": 1,
        "shape": [Q + 2 * KV, DIM],
        "split": None,
        "pieces": None,
    }


def _bad(predicate: Any, policy: Any = None, layout: str = "fused") -> None:
    # The split is checked while parameters are selected, before the mesh is looked at: no
    # process group is needed to see the error.
    dedicate_params(build(layout), None, predicate, param_policy=policy)


def _only(split: Any) -> Any:
    return lambda name, p: split if name == "layers.0.proj.0" else False


def test_a_split_that_does_not_fit_its_weight_is_refused_naming_it() -> None:
    where = r"'layers\.0\.proj\.0'"
    with pytest.raises(
        ValueError,
        match=rf"{where} has 32 rows, but its declared split's blocks \(16, 8\) add up to 24",
    ):
        _bad(_only(MatrixSplit(rows=(16, 8))))
    with pytest.raises(
        ValueError,
        match=rf"{where} has 32 rows, which its declared split's 5 heads \(heads \+ 2·kv_heads = 3 \+ 2·1\) do not divide",
    ):
        _bad(_only(MatrixSplit(heads=3, kv_heads=1)))
    with pytest.raises(
        ValueError,
        match=rf"{where} has 32 rows, but its declared split's 4 \+ 2·2 heads of head_dim 8 make 64",
    ):
        _bad(_only(MatrixSplit(heads=4, kv_heads=2, head_dim=8)))
    with pytest.raises(
        ValueError,
        match=rf"{where}: its declared split's block rows 0:6 has 6 rows, which head_dim 4 does not divide",
    ):
        _bad(_only(MatrixSplit(rows=(6, 26), head_dim=4, per_head=True)))
    # Only a Muon-route 2-D weight has matrices to split.
    adamw = {"overrides": [{"name": ["proj.0"], "set": {"route": "adamw"}}]}
    with pytest.raises(
        ValueError,
        match=rf"{where} has a declared split MatrixSplit\(heads=4, kv_heads=2\), but its route is 'adamw'",
    ):
        _bad(_only(QKV_SPLIT), adamw)
    fsdp = {
        "overrides": [{"name": ["proj.0"], "set": {"route": "sharded_adamw", "split": PER_HEAD}}]
    }
    with pytest.raises(
        ValueError, match=rf"{where} has a declared split .* but its route is 'sharded_adamw'"
    ):
        _bad(_only(True), fsdp)
    stack = Model("fused")
    stack.layers[0].experts = nn.Parameter(torch.zeros(2, 32, DIM))
    with pytest.raises(
        ValueError,
        match=r"'layers\.0\.experts' \(shape \(2, 32, 16\)\) has a declared split .* but it is an expert stack",
    ):
        dedicate_params(stack, None, lambda n, p: QKV_SPLIT if n.endswith("experts") else False)
    per_head = {"overrides": [{"name": ["proj.0"], "set": {"split": PER_HEAD}}]}
    with pytest.raises(
        ValueError,
        match=rf"{where} has two different splits: MatrixSplit\(heads=4, kv_heads=2\) from the predicate and MatrixSplit\(heads=4, kv_heads=2, per_head=True\) from param_policy",
    ):
        _bad(_only(QKV_SPLIT), per_head)
    with pytest.raises(
        ValueError,
        match=r"param_policy\['overrides'\]\[0\]\['set'\]\['split'\]: MatrixSplit: kv_heads=3 does not divide heads=4",
    ):
        _bad(
            _only(True),
            {"overrides": [{"name": ["proj.0"], "set": {"split": {"heads": 4, "kv_heads": 3}}}]},
        )
    # A Conv1D weight stores (in, out): a split of its stored rows would cut its inputs.
    transformers = pytest.importorskip("transformers")
    gpt2 = nn.Module()
    gpt2.layers = nn.ModuleList(nn.Module() for _ in range(2))
    for layer in gpt2.layers:
        layer.c_attn = transformers.pytorch_utils.Conv1D(32, DIM)  # (DIM, 32): q, k, v columns
    with pytest.raises(
        ValueError, match=r"'layers\.0\.c_attn\.weight' has a declared split .* but it is a Conv1D"
    ):
        dedicate_params(
            gpt2, None, lambda n, p: QKV_SPLIT if n.endswith("c_attn.weight") else False
        )
