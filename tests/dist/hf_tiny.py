"""Tiny random Hugging Face models of the three families, and references computed by transformers.

Each family exercises its variant: Llama 3 with the llama3 RoPE scaling (wavelengths on both
sides of the cut-offs, an untied head, a vocab not divisible by 2), Qwen2 with QKV biases and a
single kv head (replicated at tp=2), Qwen3 with QK-norm, a head_dim unlike hidden/heads and tied
embeddings. Weights are drawn fresh (norms and biases included), saved with ``save_pretrained``.
References run transformers in float64, one document at a time. transformers is imported
inside the functions: the spawned test ranks import this module and should not pay for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB = 101
BASE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=48, rms_norm_eps=1e-5)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(
        num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(num_key_value_heads=1,
                                                  tie_word_embeddings=False)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(num_key_value_heads=2, head_dim=16,
                                                  tie_word_embeddings=True)),
}


def make_hf_model(family: str, seed: int):
    """A float32 transformers model of ``family`` with fresh random weights (eval mode)."""
    import transformers  # here, not at import: spawned test ranks need not load it

    model_name, config_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**BASE, **extra)
    model = getattr(transformers, model_name)(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)
    return model


def save_hf_model(family: str, seed: int, folder) -> dict[str, torch.Tensor]:
    """Save a fresh model to ``folder``; returns its state dict (float32 tensors)."""
    model = make_hf_model(family, seed)
    model.save_pretrained(folder)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def packed_docs(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [T], cu_seqlens [D+1] int64)`` of random documents of ``lengths``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (sum(lengths),), generator=gen)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return ids, cu


def _doc_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids[None]).logits[0].double()  # (n, V)


def reference_scores(folder, ids: torch.Tensor, cu: torch.Tensor):
    """transformers (float64, per document): ``logprobs [T]``, ``entropy [T]`` with position t
    scoring token t+1 of its document (0 logprob at each document's last token)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    logprobs, entropy = torch.zeros(ids.numel(), dtype=torch.float64), torch.zeros(
        ids.numel(), dtype=torch.float64)
    with torch.no_grad():
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            logp = F.log_softmax(_doc_logits(model, ids[a:b]), dim=-1)
            entropy[a:b] = -(logp.exp() * logp).sum(-1)
            logprobs[a:b - 1] = logp[:-1].gather(1, ids[a + 1:b, None])[:, 0]
    return logprobs, entropy


def reference_loss_grads(folder, ids: torch.Tensor, cu: torch.Tensor):
    """transformers (float64): mean next-token loss over all documents, and the gradient of
    every parameter by HF name (tied: the embedding's gradient includes the head's use)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        logits = _doc_logits(model, ids[a:b])
        total = total + F.cross_entropy(logits[:-1], ids[a + 1:b], reduction="sum")
        count += b - a - 1
    loss = total / count
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    if model.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)
    return float(loss.detach()), grads
