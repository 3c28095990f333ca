"""Newton–Schulz's transient memory by live tensor storage, on the CPU (no GPU needed):

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:):testing python3 benchmarks/ns_memory.py

Each row is one call at the aspect ratio of a model's matrices, scaled down (the ratio, not the
size, sets the peak), iterating in bf16 so that the last product writes the result's dtype as
the GPU kernels' last product does. The peak is what the call's ops hold alive at once above
what existed before it (``dmuon_testing.memory``: the bytes a GPU allocator would hold for
tensors), in units of the input: for ``NewtonSchulz`` the caller's tensor, for the optimizer's
``muon_step`` the NS input stack it forms from momentum (held through the call, so counted).
Multiply by an input's bytes for its peak on a GPU: 2.29 at 2:7 is 256 MiB at 4096×14336.
"""

from __future__ import annotations

import torch

from dmuon_fsdp.optim import _muon_math
from dmuon_ns import NewtonSchulz
from dmuon_testing.memory import StoragePeak, live_storages

# (label, aspect, shape of one matrix, matrices): the optimizer rows step four at once.
NS_ROWS = [("NewtonSchulz(g), wide", "2:7 (4096×14336, 8192×28672)", (64, 224), 1)]
NS_ROWS += [("NewtonSchulz(g), tall", "7:2 (14336×4096)", (224, 64), 1)]
STEP_ROWS = [
    ("muon_step, 4 matrices", "1:3.5 (a Llama-3 MLP)", (128, 448), 4),
    ("muon_step, 4 matrices", "1:4", (256, 1024), 4),
    ("muon_step, 4 matrices", "3:8 (Qwen3-30B-A3B experts)", (96, 256), 4),
    ("muon_step, 4 matrices", "8:3 (their down projection)", (256, 96), 4),
    ("muon_step, 4 matrices", "1:1 (direct NS)", (128, 128), 4),
]


def _ns_peak(shape: tuple[int, int]) -> float:
    ns = NewtonSchulz(dtype=torch.bfloat16)
    g = torch.randn(1, *shape, dtype=torch.bfloat16)
    peak = StoragePeak(set(live_storages()))
    with peak:
        ns(g)
    return peak.peak / (g.numel() * g.element_size())


def _step_peak(shape: tuple[int, int], matrices: int) -> float:
    ns = NewtonSchulz(dtype=torch.bfloat16)
    items = []
    for _ in range(matrices):
        w = torch.randn(shape, dtype=torch.bfloat16)
        grad, buf = torch.randn_like(w), torch.zeros_like(w)
        items.append(_muon_math.MuonItem(w, grad, buf, 0.95, True, 0.02, 0.0, 1.0))
    peak = StoragePeak(set(live_storages()))
    with peak:
        _muon_math.muon_step(items, ns, max_batch_bytes=None)
    return peak.peak / (matrices * shape[0] * shape[1] * 2)


def main() -> None:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, bf16 iterations, peak above the call's start / input bytes")
    print("| call | aspect m:n | shape | peak / input |")
    print("|---|---|---|---|")
    for label, aspect, shape, _ in NS_ROWS:
        print(f"| {label} | {aspect} | {shape[0]}×{shape[1]} | {_ns_peak(shape):.3f} |")
    for label, aspect, shape, matrices in STEP_ROWS:
        ratio = _step_peak(shape, matrices)
        print(f"| {label} | {aspect} | {shape[0]}×{shape[1]} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
