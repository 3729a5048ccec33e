"""Tiny released-format VL checkpoints, made offline: tokenizer + chat template + config.json +
weights + preprocessor_config.json, as a Hub release folder holds them, for each VL family.

``make_release(arch, folder)`` writes one; ``hf_processor(arch, folder)`` builds transformers'
processor of that release (the family's processor class from the folder's tokenizer and image
processor config). Vision tokens are added special tokens INSIDE the vocabulary, after the
trained BPE pieces, and config.json names them, as in a release. Arches: ``qwen2_vl``,
``qwen2_5_vl`` (family qwen2_vl), ``qwen3_vl``, ``qwen3_5`` (Qwen3.5 vision-language,
family qwen3_5_vl), ``glm4v``; ``make_qwen35_moe_release`` writes a Qwen3.5-MoE one (family
qwen3_5_vl_moe).

torchvision is not installed here, so transformers cannot build the video processor its VL
processors hold; :func:`hf_processor` builds the processor with none (its class check
skipped), which is enough for images (the processor never touches it without videos).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer

from tests.unit.release_tokenizers import CORPUS, make_chatml

VOCAB = 416  # model rows: the trained 400 pieces + the added tokens, rounded up
QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
GLM_TOKENS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
              "<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>",
              "<|end_of_video|>", "<|video|>")

# Qwen2-VL's released template (a default system turn; images as vision start, pad, end)
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen3-VL / Qwen3.5 style: no default system turn, content parts rendered in every role
QWEN3_VL_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- else %}"
    "{%- for content in message.content %}"
    "{%- if content.type == 'image' or 'image' in content %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif content.type == 'video' or 'video' in content %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in content %}{{- content.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

QWEN_VISION = {
    "qwen2_vl": dict(depth=2, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2,
                     patch_size=2, temporal_patch_size=2, spatial_merge_size=2, in_channels=3),
    "qwen2_5_vl": dict(depth=3, hidden_size=16, out_hidden_size=32, intermediate_size=24,
                       num_heads=2, patch_size=2, temporal_patch_size=2, spatial_merge_size=2,
                       in_channels=3, window_size=8, fullatt_block_indexes=[1],
                       tokens_per_second=2),
    "qwen3_vl": dict(depth=2, hidden_size=16, num_heads=2, intermediate_size=24,
                     out_hidden_size=32, patch_size=2, temporal_patch_size=2,
                     spatial_merge_size=2, in_channels=3, num_position_embeddings=16,
                     deepstack_visual_indexes=[1]),
    "qwen3_5": dict(depth=2, hidden_size=16, num_heads=2, intermediate_size=24,
                    out_hidden_size=32, patch_size=2, temporal_patch_size=2,
                    spatial_merge_size=2, in_channels=3, num_position_embeddings=16,
                    deepstack_visual_indexes=[]),
}
QWEN_TEXT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=48, rms_norm_eps=1e-5,
                 max_position_embeddings=4096,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                  "mrope_section": [2, 1, 1]})
TEXT = {
    "qwen2_vl": QWEN_TEXT, "qwen2_5_vl": QWEN_TEXT,
    "qwen3_vl": {**QWEN_TEXT, "head_dim": 16,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                     "mrope_section": [4, 2, 2], "mrope_interleaved": True}},
    "qwen3_5": {**QWEN_TEXT, "head_dim": 16, "num_hidden_layers": 2,
                "layer_types": ["linear_attention", "full_attention"],
                "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                "linear_conv_kernel_dim": 4,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                    "partial_rotary_factor": 0.75, "mrope_section": [2, 2, 2],
                                    "mrope_interleaved": True}},
}
CLASSES = {  # model, config, processor
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", "Qwen2VLConfig", "Qwen2VLProcessor"),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig",
                   "Qwen2_5_VLProcessor"),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLConfig", "Qwen3VLProcessor"),
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", "Qwen3_5Config", "Qwen3VLProcessor"),
}
FAMILY = {"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_vl", "qwen3_vl": "qwen3_vl",
          "qwen3_5": "qwen3_5_vl", "glm4v": "glm4v"}
ARCHES = tuple(FAMILY)


def _add_tokens(folder: Path, names: tuple[str, ...]) -> dict[str, int]:
    """Add ``names`` as special tokens to the folder's tokenizer.json and config; their ids."""
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    ids = {n: tok.token_to_id(n) for n in names}
    for n, i in ids.items():
        config["added_tokens_decoder"][str(i)] = {
            "content": n, "lstrip": False, "rstrip": False, "normalized": False,
            "single_word": False, "special": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return ids


def _randomize(model, seed: int):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("A_log"):
                p.copy_(torch.log(0.02 + 0.3 * torch.rand(p.shape, generator=gen)))
            elif "norm" in name and "visual." not in name and "linear_attn.norm" not in name \
                    and "qwen3_5" in type(model).__name__.lower():
                p.copy_(0.2 * noise)  # Qwen3.5's zero-centred norms
            elif "norm" in name or "ln_q" in name:
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.12 * noise)
    return model


def _image_processor(arch: str):
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    size = {"shortest_edge": 8 * 8, "longest_edge": 24 * 24}
    if arch == "glm4v":
        return Glm4vImageProcessorPil(patch_size=2, temporal_patch_size=2, merge_size=2,
                                      size=size)
    mean = [0.5] * 3 if arch in ("qwen3_vl", "qwen3_5") else None
    kwargs = {"image_mean": mean, "image_std": mean} if mean else {}
    return Qwen2VLImageProcessorPil(patch_size=2, temporal_patch_size=2, merge_size=2,
                                    size=size, **kwargs)


def make_release(arch: str, folder, seed: int = 5, pieces: int = 400) -> Path:
    """A tiny release of ``arch`` (module docstring) in ``folder``, its BPE trained to
    ``pieces`` tokens before the added ones; returns it."""
    import transformers

    folder = Path(folder)
    if arch == "glm4v":
        return _make_glm4v(folder, seed, pieces)
    template = QWEN2_VL_TEMPLATE if arch in ("qwen2_vl", "qwen2_5_vl") else QWEN3_VL_TEMPLATE
    make_chatml(folder, pieces, template=template, corpus=CORPUS)
    ids = _add_tokens(folder, QWEN_TOKENS)
    tokens = dict(vision_start_token_id=ids["<|vision_start|>"],
                  vision_end_token_id=ids["<|vision_end|>"],
                  image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"])
    model_name, config_name, _ = CLASSES[arch]
    config = getattr(transformers, config_name)(
        text_config=dict(TEXT[arch]), vision_config=dict(QWEN_VISION[arch]),
        tie_word_embeddings=False, **tokens)
    model = _randomize(getattr(transformers, model_name)(config).eval(), seed)
    model.save_pretrained(folder)
    _image_processor(arch).save_pretrained(folder)
    return folder


# Qwen3.5-MoE VL: the qwen3_5 release's text with every MLP a MoE block (family qwen3_5_vl_moe)
QWEN35_MOE_TEXT = {k: v for k, v in TEXT["qwen3_5"].items() if k != "intermediate_size"} | dict(
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
    shared_expert_intermediate_size=40, router_aux_loss_coef=0.05)


def make_qwen35_moe_release(folder, seed: int = 5) -> Path:
    """The ``qwen3_5`` release of :func:`make_release` (tokenizer, template, processor
    config) with a ``Qwen3_5MoeForConditionalGeneration`` of ``QWEN35_MOE_TEXT`` as its model."""
    import transformers

    folder = make_release("qwen3_5", folder, seed)
    dense = json.loads((folder / "config.json").read_text())
    tokens = {k: dense[k] for k in ("vision_start_token_id", "vision_end_token_id",
                                    "image_token_id", "video_token_id")}
    config = transformers.Qwen3_5MoeConfig(
        text_config=dict(QWEN35_MOE_TEXT), vision_config=dict(QWEN_VISION["qwen3_5"]),
        tie_word_embeddings=False, **tokens)
    for old in folder.glob("model*.safetensors*"):
        old.unlink()
    model = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    _randomize(model, seed).save_pretrained(folder)
    return folder


# GLM-4.1V's layout: an assistant turn ends with no token of its own (the next role token, or
# nothing after the last turn)
GLM_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for msg in messages %}"
    "{%- if msg.role == 'system' %}{{- '<|system|>\\n' + msg.content }}"
    "{%- elif msg.role == 'user' %}{{- '<|user|>\\n' }}"
    "{%- if msg.content is string %}{{- msg.content }}{%- else %}"
    "{%- for item in msg.content %}"
    "{%- if item.type == 'video' or 'video' in item %}"
    "{{- '<|begin_of_video|><|video|><|end_of_video|>' }}"
    "{%- elif item.type == 'image' or 'image' in item %}"
    "{{- '<|begin_of_image|><|image|><|end_of_image|>' }}"
    "{%- elif item.type == 'text' %}{{- item.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{%- elif msg.role == 'assistant' %}{{- '<|assistant|>\\n' + msg.content }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}")


def _make_glm4v(folder: Path, seed: int, pieces: int) -> Path:
    import transformers

    make_chatml(folder, pieces, template=GLM_TEMPLATE, corpus=CORPUS)
    ids = _add_tokens(folder, GLM_TOKENS)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                  tokenizer_class="PreTrainedTokenizerFast")
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    tokens = dict(image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
                  image_start_token_id=ids["<|begin_of_image|>"],
                  image_end_token_id=ids["<|end_of_image|>"],
                  video_start_token_id=ids["<|begin_of_video|>"],
                  video_end_token_id=ids["<|end_of_video|>"])
    text = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, intermediate_size=48, rms_norm_eps=1e-5,
                max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.5})
    vision = dict(depth=2, hidden_size=16, num_heads=2, intermediate_size=24,
                  out_hidden_size=128, image_size=8, patch_size=2, temporal_patch_size=2,
                  spatial_merge_size=2, in_channels=3)
    config = transformers.Glm4vConfig(text_config=text, vision_config=vision,
                                      tie_word_embeddings=False, **tokens)
    model = _randomize(transformers.Glm4vForConditionalGeneration(config).eval(), seed)
    model.save_pretrained(folder)
    _image_processor("glm4v").save_pretrained(folder)
    return folder


def hf_processor(arch: str, folder, video_processor=None):
    """transformers' processor of the release at ``folder`` (module docstring): its tokenizer
    and its preprocessor_config.json through the family's image processor class;
    ``video_processor``: the one it holds (tests/unit/vl_video_reference.py), or None."""
    import transformers

    name = "Glm4vProcessor" if arch == "glm4v" else CLASSES[arch][2]

    class Processor(getattr(transformers, name)):
        def check_argument_for_proper_class(self, argument_name, argument):
            return type(argument)  # no transformers video processor class (no torchvision)

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    images = type(_image_processor(arch)).from_pretrained(str(folder))  # preprocessor_config
    return Processor(image_processor=images, tokenizer=tokenizer,
                     video_processor=video_processor, chat_template=tokenizer.chat_template)
