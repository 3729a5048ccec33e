"""Context-parallel attention: causal within documents, over packed streams split across cp.

``context_attention(q, k, v, *, doc_id, pos, cu_seqlens=None, mode, group, softmax_scale)`` is
the one entry point (``api.py``); a model passes ``plan=AttentionPlan(...)`` instead, made once
per forward, so that its layers share the metadata checks, the cp metadata gather and the
kernel plan. ``ring_attention`` and ``ulysses_attention`` are the two cp modes,
``attention_with_lse`` the primitive (flash varlen on CUDA, an exact masked reference
elsewhere). Layout and masking rules are in ``api.py``'s docstring.
"""

from mpcore.parallel.attention.api import MODES, AttentionPlan, context_attention
from mpcore.parallel.attention.primitive import attention_with_lse, use_flash
from mpcore.parallel.attention.ring import ring_attention
from mpcore.parallel.attention.ulysses import ulysses_attention

__all__ = [
    "MODES",
    "AttentionPlan",
    "attention_with_lse",
    "context_attention",
    "ring_attention",
    "ulysses_attention",
    "use_flash",
]
