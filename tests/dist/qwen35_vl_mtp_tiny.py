"""Tiny release-format Qwen3.5 VL (dense or MoE) checkpoints WITH ``mtp.*``, and a float64
reference of the MTP head on images.

The checkpoints: ``hf_qwen35_vl_tiny``'s ``Qwen3_5ForConditionalGeneration`` (or
``hf_qwen35_vl_moe_tiny``'s ``Qwen3_5MoeForConditionalGeneration``) saved with
``save_pretrained``, then the release's top-level ``mtp.*`` tensors (``qwen35_mtp_tiny`` /
``qwen35_moe_mtp_tiny`` name them) with random values, and ``text_config.mtp_num_hidden_layers:
1``. The streams are ``hf_qwen3_vl_tiny``'s (images of several grids, a 3-frame video).

The reference (transformers has no MTP module), per document in float64: transformers' VL
model runs the document; hooks catch what its language model receives, the input embeddings
WITH the tower's rows merged at the placeholders (``inputs_embeds``), and its M-RoPE tables
(``rotary_emb``'s cos / sin of the 3-row positions), and what it returns (the final-norm hidden
state; the router logits of a MoE decoder). The MTP block at t then reads ``h_t`` and the merged
embedding of token t+1 (vLLM's ``Qwen3_5MTP.embed_input_ids``; the filler id 0's plain row at a
document's last token), rotated by those same tables (transformers' ``apply_rotary_pos_emb``),
and is scored on token t+2 unless that is a placeholder. A MoE model's aux loss is
transformers' ``load_balancing_loss_func`` over the decoder's layers and the MTP layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.dist.hf_qwen3_vl_tiny import IMAGE, VIDEO, doc_inputs, load
from tests.dist.qwen35_moe_mtp_tiny import MLP, fused_mtp_experts, moe_ffn, moe_mtp_shapes
from tests.dist.qwen35_mtp_tiny import mtp_hidden, mtp_shapes

EAGER = {"experts_implementation": "eager"}  # transformers' grouped GEMM takes no float64


def make_checkpoint(folder: str | Path, seed: int = 0, moe: bool = False) -> dict:
    """Write a checkpoint (module docstring) to ``folder``; returns its text config dict."""
    if moe:
        from tests.dist.hf_qwen35_vl_moe_tiny import save_hf_model
    else:
        from tests.dist.hf_qwen35_vl_tiny import save_hf_model
    folder = Path(folder)
    save_hf_model(seed, folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    text = config["text_config"]
    shapes = moe_mtp_shapes(text) if moe else mtp_shapes(text)
    tensors = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(seed + 1)
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=gen)
        scale = 0.2 if "norm" in name else 0.5 if name == MLP + "gate.weight" else 0.12
        tensors[name] = scale * noise
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return text


def _catch(lm) -> tuple[dict, list]:
    """Hooks on the language model ``lm``: its merged ``inputs_embeds``, its rotary tables."""
    seen: dict = {}

    def before(_module, args, kwargs):
        seen["embeds"] = kwargs["inputs_embeds"]

    def tables(_module, _args, out):
        seen["cos"], seen["sin"] = out

    return seen, [lm.register_forward_pre_hook(before, with_kwargs=True),
                  lm.rotary_emb.register_forward_hook(tables)]


def _weights(folder: Path, c: dict, moe: bool) -> dict[str, torch.Tensor]:
    """The checkpoint's ``mtp.*`` tensors in float64, leaves with gradients (MoE experts
    packed: the shard map's names)."""
    raw = load_file(folder / "model.safetensors")
    w = {k: v.double() for k, v in raw.items() if k.startswith("mtp.") and ".experts." not in k}
    if moe:
        w.update({MLP + k: v.double() for k, v in
                  fused_mtp_experts(raw, c["num_experts"]).items()})
    return {k: v.requires_grad_() for k, v in w.items()}


def _document(model, c: dict, w: dict, seen: dict, kwargs: dict, ffn, moe: bool) -> dict:
    """One document's sums: next-token CE and its count, the MTP CE over non-placeholder
    t+2 targets and its count, the MTP log-probs and where they count, the router logits."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    doc, head = kwargs["input_ids"][0], model.lm_head.weight
    out = model.model(**kwargs, **({"output_router_logits": True} if moe else {}))
    hidden = out.last_hidden_state[0]  # (n, H), final-normed
    logp = F.log_softmax(hidden @ head.T, -1)
    keep = (doc[1:] != IMAGE) & (doc[1:] != VIDEO)
    res = {"ce": -logp[:-1].gather(1, doc[1:, None])[:, 0][keep].sum(),
           "ce_n": int(keep.sum()), "router": out.router_logits if moe else None}
    merged = seen["embeds"][0]  # (n, H): the tower's rows at the placeholders
    nxt = torch.cat([merged[1:], model.model.language_model.embed_tokens.weight[:1]])
    cos, sin = seen["cos"], seen["sin"]  # (1, n, rotary): the decoder's M-RoPE tables

    def rope(q, k):  # (n, heads, D) <-> transformers' (1, heads, n, D)
        q, k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        return q[0].transpose(0, 1), k[0].transpose(0, 1)

    y = mtp_hidden(w, c, hidden, None, embedded=nxt, rope=rope,
                   **({} if ffn is None else {"ffn": ffn}))  # every position: router rows
    lp = F.log_softmax(y[:-2] @ head.T, -1).gather(1, doc[2:, None])[:, 0]
    res["mtp_keep"] = (doc[2:] != IMAGE) & (doc[2:] != VIDEO)
    res["mtp_lp"] = lp
    return res


def reference(folder, s: dict, weight: float, moe: bool = False) -> dict:
    """float64 (module docstring): ``ce`` (mean over non-placeholder next tokens), ``mtp``
    (mean over non-placeholder t+2 targets), ``aux`` (MoE), ``loss = ce + weight * mtp
    (+ coef * aux)``, ``mtp_logprobs [T]`` (0 where no target) and every tensor's gradient
    by HF name (MoE experts packed: the shard map's names)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    folder = Path(folder)
    c = json.loads((folder / "config.json").read_text())["text_config"]
    model = load(folder, **(EAGER if moe else {}))
    w = _weights(folder, c, moe)
    router_mtp: list = []
    ffn = moe_ffn(c["num_experts_per_tok"], router_mtp) if moe else None
    docs = []
    logprobs = torch.zeros(s["input_ids"].numel(), dtype=torch.float64)
    seen, hooks = _catch(model.model.language_model)
    try:
        for d in range(len(s["per_doc"])):
            kwargs, a, b = doc_inputs(s, d)
            docs.append(_document(model, c, w, seen, kwargs, ffn, moe))
            r = docs[-1]
            logprobs[a:a + r["mtp_lp"].numel()] = torch.where(
                r["mtp_keep"], r["mtp_lp"], 0.0).detach()
    finally:
        for h in hooks:
            h.remove()
    ce = sum(r["ce"] for r in docs) / sum(r["ce_n"] for r in docs)
    mtp_n = sum(int(r["mtp_keep"].sum()) for r in docs)
    mtp_loss = -sum(r["mtp_lp"][r["mtp_keep"]].sum() for r in docs) / mtp_n
    loss, aux = ce + weight * mtp_loss, None
    if moe:
        layers = tuple(torch.cat([r["router"][i] for r in docs])
                       for i in range(len(docs[0]["router"])))
        aux = load_balancing_loss_func((*layers, torch.cat(router_mtp)), c["num_experts"],
                                       c["num_experts_per_tok"])
        loss = loss + c["router_aux_loss_coef"] * aux
    loss.backward()
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
             for n, p in model.named_parameters()}
    grads.update({n: t.grad.detach().clone() for n, t in w.items()})
    return {"ce": float(ce.detach()), "mtp": float(mtp_loss.detach()),
            "aux": None if aux is None else float(aux.detach()), "loss": float(loss.detach()),
            "mtp_logprobs": logprobs, "grads": grads,
            "count": sum(r["ce_n"] for r in docs), "mtp_count": mtp_n}
