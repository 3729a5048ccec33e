"""A tiny random transformers ``Qwen3_5ForConditionalGeneration`` (Qwen3.5 vision-language).

The decoder is ``qwen35_tiny``'s hybrid shape (``[linear, full, linear, linear]``, gated GQA
attention, grouped DeltaNet heads) with more DeltaNet heads (4 key, 8 value: they split over
tp x cp = 4) and three quarters of head_dim 16 rotated, so interleaved M-RoPE ``[2, 2, 2]``
spreads each of t, h, w over two of the 6 rotated pairs while 4 dims pass through. The tower is
``hf_qwen3_vl_tiny``'s without DeepStack, and the token ids, patch width and packed streams
(``stream``, ``doc_inputs``) and float64 per-document references are that module's, reused as
they are. transformers is imported inside functions: spawned test ranks import this module.
"""

from __future__ import annotations

from tests.dist.hf_qwen3_vl_tiny import TOKENS, VISION, VOCAB
from tests.dist.qwen35_tiny import HF_CONFIG, randomize_

TEXT = {**HF_CONFIG, "vocab_size": VOCAB, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.75, "mrope_section": [2, 2, 2],
                            "mrope_interleaved": True}}
TEXT.pop("tie_word_embeddings")
TOWER = {k: v for k, v in VISION.items() if k != "deepstack_visual_indexes"} | {"depth": 2}


def make_hf_model(seed: int, tie: bool = False, text=None, vision=None):
    """A float32 ``Qwen3_5ForConditionalGeneration`` with fresh random weights (eval mode)."""
    import transformers

    config = transformers.Qwen3_5Config(text_config=dict(text or TEXT),
                                        vision_config=dict(vision or TOWER),
                                        tie_word_embeddings=tie, **TOKENS)
    return randomize_(transformers.Qwen3_5ForConditionalGeneration(config).eval(), seed)


def save_hf_model(seed: int, folder, tie: bool = False) -> None:
    make_hf_model(seed, tie).save_pretrained(folder)
