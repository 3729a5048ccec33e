"""A tiny release-format Qwen3.5-MoE checkpoint WITH ``mtp.*``, and a float64 reference.

The checkpoint: ``tests.dist.qwen35_moe_tiny``'s transformers ``Qwen3_5MoeForCausalLM`` (8
experts, top-2, a shared expert; DeltaNet heads split over tp x cp = 4) saved with
``save_pretrained``, then the release's ``mtp.*`` tensors (names and shapes written out here as
the released safetensors hold them: the layer's MLP a MoE block, ``mtp.layers.0.mlp.gate``,
``experts.{j}.{gate,up,down}_proj`` one tensor per expert, or packed ``experts.gate_up_proj`` /
``down_proj`` as Qwen3.6 stores them; ``shared_expert.*``, ``shared_expert_gate``) with random
values, and ``mtp_num_hidden_layers: 1`` in config.json.

The reference (transformers has no MTP module): the decoder is transformers' model in float64,
one document at a time (its final-norm hidden state and every layer's router logits); the MTP
block is ``qwen35_mtp_tiny.mtp_hidden`` with the MoE feed-forward written out here (softmax
router, top-k renormalised, SwiGLU experts, the shared expert times ``sigmoid(gate)``). The MTP
block runs on every position of a document (the last one reads the filler id 0, as
``LabelShifter.mtp`` makes it) and its targets are t+2 within the document. The load-balancing
loss is transformers' ``load_balancing_loss_func`` over the decoder's layers AND the MTP layer
(the MTP router is balanced with the decoder's), on the whole batch:

    loss = ce + weight * mtp + router_aux_loss_coef * aux
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.dist.qwen35_moe_tiny import CONFIG, save_hf_model
from tests.dist.qwen35_mtp_tiny import HEADS, mtp_hidden, mtp_shapes

MLP = "mtp.layers.0.mlp."


def moe_mtp_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """The release's ``mtp.*`` tensors of a Qwen3.5-MoE text config ``c`` (per expert)."""
    hid, e, inter = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"]
    shared = c["shared_expert_intermediate_size"]
    out = {k: v for k, v in mtp_shapes({**c, "intermediate_size": 1}).items()
           if not k.startswith(MLP)}
    out[MLP + "gate.weight"] = (e, hid)
    for j in range(e):
        out[f"{MLP}experts.{j}.gate_proj.weight"] = (inter, hid)
        out[f"{MLP}experts.{j}.up_proj.weight"] = (inter, hid)
        out[f"{MLP}experts.{j}.down_proj.weight"] = (hid, inter)
    out[MLP + "shared_expert.gate_proj.weight"] = (shared, hid)
    out[MLP + "shared_expert.up_proj.weight"] = (shared, hid)
    out[MLP + "shared_expert.down_proj.weight"] = (hid, shared)
    out[MLP + "shared_expert_gate.weight"] = (1, hid)
    return out


def make_checkpoint(folder: str | Path, seed: int = 9, packed: bool = False,
                    **overrides) -> dict:
    """Write the checkpoint (module docstring) to ``folder``; returns its config dict. The
    ``mtp.*`` values depend on ``seed`` only, not on ``packed``."""
    folder = Path(folder)
    save_hf_model(seed, folder, **{**HEADS, **overrides})
    config = json.loads((folder / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(seed + 1)
    c = {**CONFIG, **HEADS, **overrides}
    for name, shape in moe_mtp_shapes(c).items():
        noise = torch.randn(shape, generator=gen)
        scale = 0.2 if "norm" in name else 0.5 if name == MLP + "gate.weight" else 0.12
        tensors[name] = scale * noise  # norms zero-centred; a sharp router (far from ties)
    if packed:  # the same values, stored as Qwen3.6 stores them
        fused = fused_mtp_experts(tensors, c["num_experts"])
        tensors = {k: v for k, v in tensors.items() if not k.startswith(MLP + "experts.")}
        tensors.update({MLP + k: v for k, v in fused.items()})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return config


def fused_mtp_experts(raw: dict[str, torch.Tensor], num_experts: int) -> dict:
    """The MTP experts of ``raw`` (either layout) as packed ``[E, 2I, H]`` / ``[E, H, I]``."""
    if MLP + "experts.gate_up_proj" in raw:
        return {k: raw[MLP + k] for k in ("experts.gate_up_proj", "experts.down_proj")}
    e = range(num_experts)
    up = [torch.cat([raw[f"{MLP}experts.{j}.{p}_proj.weight"] for p in ("gate", "up")])
          for j in e]
    return {"experts.gate_up_proj": torch.stack(up),
            "experts.down_proj": torch.stack([raw[f"{MLP}experts.{j}.down_proj.weight"]
                                              for j in e])}


def moe_ffn(top_k: int, router: list):
    """The MTP layer's MoE feed-forward as ``mtp_hidden``'s ``ffn``; appends its router
    logits ``[n, E]`` to ``router``."""

    def ffn(w: dict, m: torch.Tensor) -> torch.Tensor:
        logits = m @ w[MLP + "gate.weight"].T
        router.append(logits)
        weights, experts = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        up, down = w[MLP + "experts.gate_up_proj"], w[MLP + "experts.down_proj"]
        out = torch.zeros_like(m)
        for slot in range(top_k):
            g, u = torch.einsum("nh,nih->ni", m, up[experts[:, slot]]).chunk(2, -1)
            y = torch.einsum("ni,nhi->nh", F.silu(g) * u, down[experts[:, slot]])
            out = out + weights[:, slot, None] * y
        s = MLP + "shared_expert."
        shared = (F.silu(m @ w[s + "gate_proj.weight"].T) * (m @ w[s + "up_proj.weight"].T)
                  ) @ w[s + "down_proj.weight"].T
        return out + torch.sigmoid(m @ w[MLP + "shared_expert_gate.weight"].T) * shared

    return ffn


def reference(folder, ids: torch.Tensor, cu: torch.Tensor, weight: float) -> dict:
    """float64 (module docstring): ``ce``, ``mtp``, ``aux``, ``loss``, the MTP log-probs
    ``[T]`` (position t scores t+2; 0 where there is none), the counts, and the gradient of
    ``loss`` for every tensor by HF name (experts packed: the shard map's names)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from tests.dist.hf_moe_tiny import _load

    folder = Path(folder)
    c = json.loads((folder / "config.json").read_text())
    model = _load(folder)
    raw = load_file(folder / "model.safetensors")
    mtp = {k: v.double() for k, v in raw.items() if k.startswith("mtp.")
           and ".experts." not in k}
    mtp.update({MLP + k: v.double() for k, v in
                fused_mtp_experts(raw, c["num_experts"]).items()})
    for t in mtp.values():
        t.requires_grad_()
    params = dict(model.named_parameters())
    w = {**mtp, "model.embed_tokens.weight": params["model.embed_tokens.weight"]}
    head = params["lm_head.weight"]
    ce_sum, ce_n, mtp_sum, mtp_n = 0.0, 0, 0.0, 0
    logprobs = torch.zeros(ids.numel(), dtype=torch.float64)
    decoder_router, mtp_router = [], []
    ffn = moe_ffn(c["num_experts_per_tok"], mtp_router)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        out = model.model(ids[None, a:b], output_router_logits=True)
        hidden = out.last_hidden_state[0]  # (n, H), final-normed
        decoder_router.append(out.router_logits)
        logp = F.log_softmax(hidden @ head.T, -1)
        ce_sum = ce_sum - logp[:-1].gather(1, ids[a + 1:b, None]).sum()
        ce_n += b - a - 1
        nxt = torch.cat([ids[a + 1:b], torch.zeros(1, dtype=ids.dtype)])  # filler id 0 last
        y = mtp_hidden(w, c, hidden, nxt, ffn=ffn)  # every position: its router rows count
        if b - a < 3:
            continue
        lp = F.log_softmax(y[:-2] @ head.T, -1).gather(1, ids[a + 2:b, None])[:, 0]
        logprobs[a:b - 2] = lp.detach()
        mtp_sum = mtp_sum - lp.sum()
        mtp_n += b - a - 2
    layers = tuple(torch.cat([r[i] for r in decoder_router])
                   for i in range(len(decoder_router[0])))
    aux = load_balancing_loss_func((*layers, torch.cat(mtp_router)), c["num_experts"],
                                   c["num_experts_per_tok"])
    ce, mtp_loss = ce_sum / ce_n, mtp_sum / mtp_n
    loss = ce + weight * mtp_loss + c["router_aux_loss_coef"] * aux
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in params.items()}
    grads.update({n: t.grad.detach().clone() for n, t in mtp.items()})
    return {"ce": float(ce.detach()), "mtp": float(mtp_loss.detach()),
            "aux": float(aux.detach()), "loss": float(loss.detach()), "mtp_logprobs": logprobs,
            "grads": grads, "count": ce_n, "mtp_count": mtp_n,
            "rows": sum(int(r.shape[0]) for r in mtp_router)}
