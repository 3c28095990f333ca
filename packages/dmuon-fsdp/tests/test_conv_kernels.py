"""Convolution kernels on the Muon route: each is one ``(out, in/groups·∏k)`` matrix, as Keller
Jordan's Muon flattens conv filters (see [Note: what Muon steps])."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _models import shard_layers_then_root
from _reference import Hyper, ReferenceMuonAdamW
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dmuon_fsdp import (
    Muon,
    dedicate_params,
    get_model_state_dict,
    get_owned_params,
    summarize_param_groups,
)
from dmuon_fsdp._matrix import LrScaling, MatrixView
from dmuon_ownership import ns_cost
from dmuon_testing.distributed import one_gpu_world, run_distributed

HYPER = Hyper()
STEPS = 3


def test_a_kernel_is_one_flattened_matrix() -> None:
    view = MatrixView.of((8, 2, 3, 3), "conv.weight", kernel=True)
    assert view.stack_shape == (1, 8, 18) and view.experts is None
    assert view.lr_scale(LrScaling.MOONLIGHT) == pytest.approx(0.2 * math.sqrt(18))
    kernel = torch.zeros(8, 2, 3, 3)
    (matrix,) = view.matrices(kernel)
    matrix[1].fill_(1.0)  # a view: the writes reach output channel 1's filters
    assert kernel[1].sum() == 18 and kernel.sum() == 18
    # a Conv1d's 3-D kernel is one matrix too, not a stack of experts
    assert MatrixView.of((4, 4, 3), kernel=True).stack_shape == (1, 4, 12)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1, groups=2)  # kernel (4, 2, 3, 3)
        self.conv1d = nn.Conv1d(4, 4, 3, padding=1, bias=False)  # kernel (4, 4, 3)
        self.mix = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv1d(F.gelu(self.conv(x)).flatten(2)).view_as(x)
        return x + self.mix(y.transpose(1, 3)).transpose(1, 3)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(4, 5)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean((2, 3)))


def _batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 4, 5, 5, generator=g), torch.randint(0, 5, (4,), generator=g)


def _muon(name: str, p: nn.Parameter) -> bool:
    return name.startswith("layers.") and p.ndim >= 2


def _refuse_tensor_parallel(world_size: int) -> None:
    """A convolution's kernel sharded over TP ranks is refused before anything is set up."""
    model = ConvNet()
    conv = model.layers[0].conv
    tp_mesh = init_device_mesh("cpu", (world_size,))
    conv.weight = nn.Parameter(distribute_tensor(conv.weight.detach(), tp_mesh, [Shard(0)]))
    with pytest.raises(
        ValueError,
        match=r"'layers\.0\.conv\.weight' \(shape \(4, 2, 3, 3\)\) is the kernel of a "
        r"tensor-parallel Conv2d \(sharded over 2 TP ranks\).*route its kernel to 'adamw'",
    ):
        dedicate_params(model, tp_mesh, lambda n, p: n == "layers.0.conv.weight")
    # the fix it names: on the AdamW route the kernel is taken (data parallel over one rank)
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    model = ConvNet()
    conv = model.layers[0].conv
    conv.weight = nn.Parameter(distribute_tensor(conv.weight.detach(), mesh["tp"], [Shard(0)]))
    policy = {"defaults": {"route": "adamw"}}
    runtime = dedicate_params(
        model, mesh["dp"], lambda n, p: n == "layers.0.conv.weight", param_policy=policy
    )
    assert [dp.route.value for dp in runtime.params] == ["adamw"]


def _train(rank: int, world_size: int) -> dict:
    _refuse_tensor_parallel(world_size)
    torch.manual_seed(0)
    model = ConvNet()
    reference = ConvNet()
    reference.load_state_dict(model.state_dict())
    mesh = init_device_mesh("cpu", (world_size,))
    runtime = dedicate_params(model, mesh, _muon)
    shard_layers_then_root(model, mesh)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    names = [n for n, p in reference.named_parameters() if _muon(n, p)]
    ref_opt = ReferenceMuonAdamW(reference, names, HYPER)
    losses, ref_losses = [], []
    for step in range(STEPS):
        x, y = _batch(step)
        per = x.shape[0] // world_size
        optimizer.zero_grad()
        loss = F.cross_entropy(
            model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per]
        )
        loss.backward()
        optimizer.step()
        dist.all_reduce(loss := loss.detach().clone())
        losses.append(loss.item() / world_size)
        ref_opt.zero_grad()
        ref_loss = F.cross_entropy(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_losses.append(ref_loss.item())
    # The clip gets each kernel's gradient as the one matrix Muon steps (a per-matrix clip
    # takes a gradient of more dims as a batch of (kh, kw) slices), a view it scales in place.
    loss = F.cross_entropy(
        model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per]
    )
    loss.backward()
    handed = optimizer.grads_for_clip("muon").grads
    owned = get_owned_params(model, rank)
    clip = {
        "handed": sorted(tuple(g.shape) for g in handed),
        "owned": sorted((dp.shape[0], dp.grad.numel() // dp.shape[0]) for dp in owned),
        "in_place": all(any(g.data_ptr() == dp.grad.data_ptr() for g in handed) for dp in owned),
    }
    optimizer.zero_grad()
    rows = {
        row["name"]: row["matrices"]
        for group in summarize_param_groups(model, optimizer)
        for row in group["rows"]
    }
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "weights": get_model_state_dict(model),
        "ref_weights": reference.state_dict(),
        "matrices": rows["layers.0.conv.weight"],
        "loads": runtime.plan.loads,
        "routes": {dp.fqn: dp.route.value for dp in runtime.params},
        "clip": clip,
    }


@pytest.mark.distributed
def test_conv_kernels_train_as_flattened_matrices_like_the_reference() -> None:
    """Conv2d (grouped) and Conv1d kernels on 2 ranks against the single-process reference
    that flattens each by hand; a Conv1d's 3-D kernel is dedicated, not an expert stack; a
    tensor-parallel kernel is refused, naming the fix; the clip gets each kernel's gradient as
    its flattened matrix."""
    results = run_distributed(_train, 2)
    got = results[0]
    for result in results:
        assert result["clip"]["handed"] == result["clip"]["owned"] and result["clip"]["in_place"]
    assert sum(len(r["clip"]["owned"]) for r in results) == 6
    assert got["routes"]["layers.0.conv1d.weight"] == "muon"  # dedicated, not left to FSDP2
    for a, b in zip(got["losses"], got["ref_losses"], strict=True):
        assert abs(a - b) <= 1e-6, (got["losses"], got["ref_losses"])
    # fp32: Newton–Schulz amplifies the rounding of the averaged gradients (1.1e-6 measured,
    # the reference against itself with the batch summed in another order 3e-6); orthogonalising
    # each (kh, kw) slice instead moves the kernels by 0.1
    for name, want in got["ref_weights"].items():
        torch.testing.assert_close(got["weights"][name], want, rtol=0, atol=5e-6, msg=name)
    assert got["matrices"] == {"count": 1, "shape": [4, 18], "split": None, "pieces": None}
    # The planner weighs the flattened matrices' Newton–Schulz, not (kh, kw) slices'.
    muon = 2 * (ns_cost((4, 18)) + ns_cost((4, 12)) + ns_cost((4, 4)))
    assert math.fsum(got["loads"]) == muon


class _GpuNet(nn.Module):
    """Kernels flattened wide, tall ((64, 16): its NS result is a transposed view) and grouped,
    and a Conv1d under the root."""

    def __init__(self) -> None:
        super().__init__()
        convs = [nn.Conv2d(8, 16, 3, padding=1), nn.Conv2d(16, 64, 1)]
        convs.append(nn.Conv2d(64, 8, 3, padding=1, groups=2))
        self.layers = nn.ModuleList(
            [nn.Sequential(convs[0], nn.ReLU(), convs[1], nn.ReLU(), convs[2])]
        )
        self.conv1d = nn.Conv1d(8, 8, 5, padding=2)
        self.head = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(self.conv1d(x.flatten(2)).mean(-1))


def _gpu_steps(device: torch.device, kernels: bool) -> dict[str, Tensor]:
    from dmuon_fsdp.optim import _fused

    torch.manual_seed(0)
    model = _GpuNet().to(device)
    mesh = init_device_mesh("cuda", (1,))
    dedicate_params(
        model, mesh, lambda n, p: p.ndim >= 2 and "head" not in n, hook_boundary_strict=False
    )
    shard_layers_then_root(model, mesh)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    _fused._join_background()
    use_kernels = _fused._use_kernels
    if not kernels:
        _fused._use_kernels = lambda *tensors: False
    try:
        g = torch.Generator(device=device).manual_seed(1)
        for _ in range(4):
            optimizer.zero_grad()
            model(torch.randn(4, 8, 12, 12, device=device, generator=g)).square().mean().backward()
            optimizer.step()
    finally:
        _fused._use_kernels = use_kernels
    return get_model_state_dict(model)


@pytest.mark.gpu
def test_kernels_through_the_fused_passes_give_the_torch_ops_bits() -> None:
    """The fused Triton passes read and write a kernel through its flattened views (a tall one
    tiled, [Note: transposed updates] in optim/_fused) with the torch ops' bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with one_gpu_world() as device:
        fused, plain = _gpu_steps(device, True), _gpu_steps(device, False)
    kernels = sorted(k for k, v in fused.items() if v.ndim >= 3)
    assert len(kernels) == 4, kernels
    for key, value in fused.items():
        assert torch.equal(value, plain[key]), key
