"""A tiny random transformers ``Qwen3_5ForCausalLM`` and its float64 references, per document.

Shapes exercise what Qwen3.5 adds: 4 layers ``[linear, full, linear, linear]``, GQA (4 query
heads, 2 kv heads) with the output gate, head_dim 16 with a quarter rotated, DeltaNet value
heads grouped over key heads (2 key heads, 4 value heads), a 4-tap conv, zero-centred norms
with non-trivial weights, an untied head. Shared by the unit and the dist tests; transformers
is imported inside the functions (spawned ranks need not load it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB = 101
HF_CONFIG = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=48, rms_norm_eps=1e-5,
                 layer_types=["linear_attention", "full_attention", "linear_attention",
                              "linear_attention"],
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                 linear_value_head_dim=8, linear_conv_kernel_dim=4, tie_word_embeddings=False,
                 max_position_embeddings=512,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 0.25})


def make_hf_model(seed: int, **overrides):
    """A float32 ``Qwen3_5ForCausalLM`` with fresh random weights (eval mode)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**HF_CONFIG, **overrides})).eval()
    return randomize_(model, seed)


def check_per_document(hf, logprobs: torch.Tensor, ids: torch.Tensor, cu: torch.Tensor) -> None:
    """Our ``logprobs [T]`` of the packed ``ids [T]`` (documents at ``cu``) within 1e-4 of the
    transformers model ``hf`` run on one document at a time (each document's last position
    predicts nothing and is not compared)."""
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        with torch.no_grad():
            logp = torch.log_softmax(hf(input_ids=ids[None, a:b]).logits[0], -1)
        want = logp[:-1].gather(1, ids[a + 1:b, None])[:, 0]
        assert (logprobs[a:b - 1] - want).abs().max() < 1e-4


def conditional_generation(text_config: dict, family: str):
    """A transformers ``<family>ForConditionalGeneration`` (``Qwen3_5`` or ``Qwen3_5Moe``) in the
    released checkpoints' form (nested ``text_config``, a one-block tower) over ``text_config``,
    its language model's weights moved by 0.1 x N(0, 1) (seed 1; ``A_log`` kept). Eval mode."""
    import transformers

    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32,
                  out_hidden_size=32, patch_size=4, num_position_embeddings=16)
    config = getattr(transformers, f"{family}Config")(text_config=text_config,
                                                      vision_config=vision)
    hf = getattr(transformers, f"{family}ForConditionalGeneration")(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "language_model" in name and "A_log" not in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return hf


def randomize_(model, seed: int):
    """Fresh random weights in place (returns ``model``): weak DeltaNet decays, zero-centred
    decoder norms near 0, the gated norm and a tower's LayerNorms (``visual.``) near 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("A_log"):  # weak decays: the state reaches far (a leak shows)
                p.copy_(torch.log(0.02 + 0.3 * torch.rand(p.shape, generator=gen)))
            elif "norm" in name and "linear_attn.norm" not in name and "visual." not in name:
                p.copy_(0.2 * noise)  # zero-centred
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.12 * noise)
    return model


def packed_docs(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (sum(lengths),), generator=gen)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return ids, cu


def reference(folder, ids: torch.Tensor, cu: torch.Tensor) -> dict:
    """transformers in float64, one document at a time: ``logprobs [T]`` (position t scores
    token t+1; 0 at each document's last token), the mean next-token ``loss`` and every
    parameter's gradient by HF name."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    logprobs = torch.zeros(ids.numel(), dtype=torch.float64)
    total, count = torch.zeros((), dtype=torch.float64), 0
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        logp = F.log_softmax(model(ids[None, a:b]).logits[0].double(), dim=-1)
        logprobs[a:b - 1] = logp[:-1].gather(1, ids[a + 1:b, None])[:, 0].detach()
        total = total - logp[:-1].gather(1, ids[a + 1:b, None]).sum()
        count += b - a - 1
    loss = total / count
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return {"logprobs": logprobs, "loss": float(loss.detach()), "grads": grads}
