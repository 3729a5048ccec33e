"""A tiny random transformers Qwen3-MoE, and its references (float64, one document at a time).

Three layers: 0 and 2 sparse, 1 dense (``mlp_only_layers``), 8 experts, top-2, renormalised,
a head_dim unlike hidden / heads, an untied head. The aux-loss reference runs every document
alone with ``output_router_logits=True``, concatenates each layer's router logits over the
documents and calls transformers' own ``load_balancing_loss_func`` on them: the whole batch as
one process sees it. transformers is imported inside the functions (spawned ranks need not).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpcore.models.common.moe_loss import aux_share, global_counts

VOCAB = 97
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, intermediate_size=40, rms_norm_eps=1e-5,
              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
              norm_topk_prob=True, mlp_only_layers=[1], router_aux_loss_coef=0.05,
              tie_word_embeddings=False)


def make_hf_model(seed: int, **overrides):
    """A float32 ``Qwen3MoeForCausalLM`` with fresh random weights (eval mode)."""
    import transformers

    config = transformers.Qwen3MoeConfig(**{**CONFIG, **overrides})
    return randomise_moe(transformers.Qwen3MoeForCausalLM(config).eval(), seed)


def randomise_moe(model, seed: int):
    """``model`` (a transformers MoE model) with fresh random weights from ``seed``: norms near
    1, the rest 0.15 x N(0, 1), the routers 0.5 x (also the Qwen3-VL-MoE tests')."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            # A sharp router (0.5) so the top-k choice is far from ties.
            scale = 0.5 if name.endswith("mlp.gate.weight") else 0.15
            p.copy_(1.0 + 0.2 * noise if "norm" in name else scale * noise)
    return model


def save_hf_model(seed: int, folder, **overrides) -> None:
    make_hf_model(seed, **overrides).save_pretrained(folder)


def packed_docs(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (sum(lengths),), generator=gen)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return ids, cu


def _load(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64,
                                                experts_implementation="eager").eval()


def reference(folder, ids: torch.Tensor, cu: torch.Tensor, grads: bool = True) -> dict:
    """transformers in float64 on the documents of one packed stream: ``logprobs [T]`` (0 at
    each document's last token), ``ce`` (mean next-token loss), ``aux`` (whole batch),
    ``loss = ce + router_aux_loss_coef * aux`` and, with ``grads``, every parameter's
    gradient of ``loss`` by HF name."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = _load(folder)
    cfg = model.config
    logprobs = torch.zeros(ids.numel(), dtype=torch.float64)
    total, count, router = torch.zeros((), dtype=torch.float64), 0, []
    with torch.set_grad_enabled(grads):
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            out = model(ids[a:b][None], output_router_logits=True)
            logp = F.log_softmax(out.logits[0].double(), dim=-1)
            logprobs[a:b - 1] = logp[:-1].gather(1, ids[a + 1:b, None])[:, 0].detach()
            total = total + F.nll_loss(logp[:-1], ids[a + 1:b], reduction="sum")
            count += b - a - 1
            router.append(out.router_logits)
        per_layer = tuple(torch.cat([r[i] for r in router]) for i in range(len(router[0])))
        aux = load_balancing_loss_func(per_layer, cfg.num_experts, cfg.num_experts_per_tok)
        ce = total / count
        loss = ce + cfg.router_aux_loss_coef * aux
        out = {"logprobs": logprobs, "ce": float(ce.detach()), "aux": float(aux.detach()),
               "loss": float(loss.detach())}
        if grads:
            loss.backward()
            out["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out


def backward_loss_with_aux(model, cfg, inputs: dict, num_targets: int):
    """One process's training loss on ``inputs`` (the per-token loss summed over
    ``num_targets`` targets, plus ``router_aux_loss_coef`` x the aux loss of the whole batch,
    the references' form), backpropagated into ``model``'s ``.grad``; ``(aux, loss, the router statistics)``."""
    per_token = model(**inputs, output="loss")
    stats = model.router_stats()
    counts, rows = global_counts([stats], None)
    aux = aux_share(stats, counts, rows)
    loss = per_token.sum() / num_targets + cfg.router_aux_loss_coef * aux
    loss.backward()
    return float(aux.detach()), float(loss.detach()), stats
