"""QK-clip (MuonClip): the clip itself, the row maps of fused or latent attentions, and the
helpers an attention uses to report its largest logits (re-exported from ``dmuon_fsdp``).

    from dmuon.qk_clip import QKClip, QKRowMap, max_logits
"""

from dmuon_fsdp import QKClip as QKClip
from dmuon_fsdp import QKRowMap as QKRowMap
from dmuon_fsdp import max_logits as max_logits
from dmuon_fsdp import max_logits_from_lse as max_logits_from_lse
from dmuon_fsdp import max_logits_from_scores as max_logits_from_scores

__all__ = sorted(n for n in dict(globals()) if not n.startswith("_"))
