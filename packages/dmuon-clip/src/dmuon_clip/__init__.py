"""dmuon-clip: gradient clipping for dmuon's Muon parameters and a fused segmented clip.

``clip_grad_norm_(optimizer, max_norm)`` clips the Muon grads only (``clip_grad_value_``
clamps them);
``clip_grad_norm_buckets_(buckets, max_norm)`` clips several buckets, each by its own norm.
"""

from dmuon_clip._buckets import clip_grad_norm_buckets_, try_clip_optimizer_grad_norm_buckets_
from dmuon_clip._muon import clip_grad_norm_, clip_grad_value_, clip_grads_with_norm_
from dmuon_clip._strategy import (
    MuonGradClipStrategy,
    register_muon_grad_clip_strategy,
    registered_muon_grad_clip_strategies,
    unregister_muon_grad_clip_strategy,
)
from dmuon_clip._types import (
    GradClipBucket,
    GradClipBucketStats,
    MuonClipGradsLike,
    MuonGradClipStats,
    SegmentedGradClipResult,
    SupportsMuonGradsForClip,
)

__all__ = [
    "GradClipBucket",
    "GradClipBucketStats",
    "MuonClipGradsLike",
    "MuonGradClipStats",
    "MuonGradClipStrategy",
    "SegmentedGradClipResult",
    "SupportsMuonGradsForClip",
    "clip_grad_norm_",
    "clip_grad_norm_buckets_",
    "clip_grad_value_",
    "clip_grads_with_norm_",
    "register_muon_grad_clip_strategy",
    "registered_muon_grad_clip_strategies",
    "try_clip_optimizer_grad_norm_buckets_",
    "unregister_muon_grad_clip_strategy",
]
