"""Context-parallel attention: causal within documents, over packed streams split across cp.

``context_attention(q, k, v, *, doc_id, pos, cu_seqlens=None, mode, group, softmax_scale)`` is
the one entry point (``api.py``); ``ring_attention`` and ``ulysses_attention`` are the two cp
modes, ``attention_with_lse`` the primitive (flash varlen on CUDA, an exact masked reference
elsewhere). Layout and masking rules are in ``api.py``'s docstring.
"""

from parallel.attention.api import MODES, context_attention
from parallel.attention.primitive import attention_with_lse, use_flash
from parallel.attention.ring import ring_attention
from parallel.attention.ulysses import ulysses_attention

__all__ = [
    "MODES",
    "attention_with_lse",
    "context_attention",
    "ring_attention",
    "ulysses_attention",
    "use_flash",
]
