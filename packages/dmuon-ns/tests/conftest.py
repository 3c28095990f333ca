"""Shared test setup for dmuon-ns."""

import torch

# The test matrices are small (≤ 128 on a side): one intra-op thread is faster for them than
# two, and far faster when the CI machine's cores are busy (spinning BLAS threads then stall).
torch.set_num_threads(1)
