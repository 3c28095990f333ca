"""dmuon-clip: gradient clipping for dmuon's Muon parameters and a fused segmented clip.

    stats = dmuon_clip.clip_grad_norm_(optimizer, max_norm=1.0)          # Muon grads only
    result = dmuon_clip.clip_grad_norm_buckets_(buckets, max_norm=1.0)   # per-bucket norms
"""

from dmuon_clip._buckets import clip_grad_norm_buckets_, try_clip_optimizer_grad_norm_buckets_
from dmuon_clip._muon import clip_grad_norm_
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
    "register_muon_grad_clip_strategy",
    "registered_muon_grad_clip_strategies",
    "try_clip_optimizer_grad_norm_buckets_",
    "unregister_muon_grad_clip_strategy",
]
