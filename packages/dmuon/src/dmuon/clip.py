"""Clipping: Muon-aware global-norm clipping, its strategies, and bucketed clipping with a
fused kernel (re-exported from ``dmuon_clip``).

    from dmuon.clip import clip_grad_norm_, register_muon_grad_clip_strategy
"""

from dmuon_clip import GradClipBucket as GradClipBucket
from dmuon_clip import GradClipBucketStats as GradClipBucketStats
from dmuon_clip import MuonGradClipStats as MuonGradClipStats
from dmuon_clip import SegmentedGradClipResult as SegmentedGradClipResult
from dmuon_clip import clip_grad_norm_ as clip_grad_norm_
from dmuon_clip import clip_grad_norm_buckets_ as clip_grad_norm_buckets_
from dmuon_clip import clip_grad_value_ as clip_grad_value_
from dmuon_clip import clip_grads_with_norm_ as clip_grads_with_norm_
from dmuon_clip import register_muon_grad_clip_strategy as register_muon_grad_clip_strategy
from dmuon_clip import (
    try_clip_optimizer_grad_norm_buckets_ as try_clip_optimizer_grad_norm_buckets_,
)

__all__ = sorted(n for n in dict(globals()) if not n.startswith("_"))
