"""A tiny release-format Qwen3.5 checkpoint WITH ``mtp.*``, and a float64 reference of MTP.

The checkpoint: ``tests.dist.qwen35_tiny``'s transformers ``Qwen3_5ForCausalLM`` saved with
``save_pretrained``, then the release's ``mtp.*`` tensors (names and shapes written out here, as
in the released safetensors, independent of our shard map) added with random values, and
``mtp_num_hidden_layers: 1`` in config.json. transformers has no MTP module: the reference
computes the definition with plain torch ops in float64 from the same tensors:

    h_t  = transformers' final-norm hidden state at t (one document at a time)
    x_t  = mtp.fc([norm_e(embed(id_{t+1})) | norm_h(h_t)])
    y_t  = mtp.layers.0(x_t)     gated full attention + SwiGLU, zero-centred norms, partial RoPE
    loss = mean over t with t+2 in t's document (and loss_mask[t+2]) of CE(lm_head(norm(y_t)), id_{t+2})
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.dist.qwen35_tiny import HF_CONFIG, make_hf_model

HEADS = dict(linear_num_key_heads=4, linear_num_value_heads=8)  # split over tp x cp = 4


def mtp_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """The release's ``mtp.*`` tensors of a text config ``c`` (one layer, full attention)."""
    hid, d, heads, kv = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c[
        "num_key_value_heads"]
    inter, layer = c["intermediate_size"], "mtp.layers.0."
    return {"mtp.fc.weight": (hid, 2 * hid), "mtp.pre_fc_norm_embedding.weight": (hid,),
            "mtp.pre_fc_norm_hidden.weight": (hid,), "mtp.norm.weight": (hid,),
            layer + "input_layernorm.weight": (hid,),
            layer + "post_attention_layernorm.weight": (hid,),
            layer + "self_attn.q_proj.weight": (2 * heads * d, hid),
            layer + "self_attn.k_proj.weight": (kv * d, hid),
            layer + "self_attn.v_proj.weight": (kv * d, hid),
            layer + "self_attn.o_proj.weight": (hid, heads * d),
            layer + "self_attn.q_norm.weight": (d,), layer + "self_attn.k_norm.weight": (d,),
            layer + "mlp.gate_proj.weight": (inter, hid), layer + "mlp.up_proj.weight": (inter, hid),
            layer + "mlp.down_proj.weight": (hid, inter)}


def make_checkpoint(folder: str | Path, seed: int = 9, **overrides) -> dict:
    """Write the checkpoint (module docstring) to ``folder``; returns its config dict."""
    folder = Path(folder)
    make_hf_model(seed=seed, **{**HEADS, **overrides}).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(seed + 1)
    for name, shape in mtp_shapes({**HF_CONFIG, **HEADS, **overrides}).items():
        noise = torch.randn(shape, generator=gen)
        tensors[name] = 0.2 * noise if "norm" in name else 0.12 * noise  # norms zero-centred
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return config


def _norm(x, w, eps):  # zero-centred RMSNorm, float64
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _rope(x, rotary: int, theta: float):  # x (T, heads, D): the first `rotary` dims rotate
    pos = torch.arange(x.shape[0], dtype=torch.float64)
    inv = 1.0 / theta ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
    ang = torch.outer(pos, inv)
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    r, rest = x[..., :rotary], x[..., rotary:]
    half = torch.cat([-r[..., rotary // 2:], r[..., :rotary // 2]], -1)
    return torch.cat([r * cos + half * sin, rest], -1)


def swiglu(w: dict, m: torch.Tensor) -> torch.Tensor:
    """The release's dense MTP feed-forward (``mtp.layers.0.mlp.*``) of ``m [n, H]``."""
    p = "mtp.layers.0.mlp."
    return (F.silu(m @ w[p + "gate_proj.weight"].T) * (m @ w[p + "up_proj.weight"].T)
            ) @ w[p + "down_proj.weight"].T


def mtp_hidden(w: dict, c: dict, hidden: torch.Tensor, next_ids: torch.Tensor | None,
               ffn=swiglu, embedded: torch.Tensor | None = None, rope=None) -> torch.Tensor:
    """The MTP block's normalised output ``[n, H]`` of one document's first n positions:
    ``hidden [n, H]`` the decoder's final hidden states, ``next_ids [n]`` the tokens t+1 (or
    ``embedded [n, H]``, their embeddings: a VL model's with the tower rows merged);
    ``ffn(w, m)``: the layer's feed-forward (Qwen3.5-MoE's: a MoE block); ``rope(q, k)``:
    the rotation of ``[n, heads, D]`` queries and keys (None: 1-D RoPE at 0..n-1)."""
    eps, d, heads, kv = c["rms_norm_eps"], c["head_dim"], c["num_attention_heads"], c[
        "num_key_value_heads"]
    params = c["rope_parameters"]
    rotary = int(d * params["partial_rotary_factor"])
    if rope is None:
        def rope(q, k):
            return (_rope(q, rotary, params["rope_theta"]),
                    _rope(k, rotary, params["rope_theta"]))
    p = "mtp.layers.0."
    e = w["model.embed_tokens.weight"][next_ids] if embedded is None else embedded
    x = torch.cat([_norm(e, w["mtp.pre_fc_norm_embedding.weight"], eps),
                   _norm(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)], -1)
    x = x @ w["mtp.fc.weight"].T  # (n, H): the residual stream
    n = x.shape[0]
    a = _norm(x, w[p + "input_layernorm.weight"], eps)
    qg = (a @ w[p + "self_attn.q_proj.weight"].T).view(n, heads, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(n, heads * d)
    k = (a @ w[p + "self_attn.k_proj.weight"].T).view(n, kv, d)
    v = (a @ w[p + "self_attn.v_proj.weight"].T).view(n, kv, d)
    q, k = rope(_norm(q, w[p + "self_attn.q_norm.weight"], eps),
                _norm(k, w[p + "self_attn.k_norm.weight"], eps))
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    attn = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    out = torch.einsum("hqk,khd->qhd", attn, v).reshape(n, heads * d)
    x = x + (out * torch.sigmoid(gate)) @ w[p + "self_attn.o_proj.weight"].T
    m = _norm(x, w[p + "post_attention_layernorm.weight"], eps)
    x = x + ffn(w, m)
    return _norm(x, w["mtp.norm.weight"], eps)


def reference(folder, ids: torch.Tensor, cu: torch.Tensor, weight: float) -> dict:
    """float64, one document at a time: the main mean loss, the MTP mean loss, the MTP
    log-probs ``[T]`` (position t scores token t+2; 0 where there is none) and the gradient of
    ``main + weight * mtp`` for every tensor of the checkpoint, by HF name."""
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    c = json.loads((folder / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    raw = load_file(folder / "model.safetensors")
    mtp = {k: v.double().requires_grad_() for k, v in raw.items() if k.startswith("mtp.")}
    params = dict(model.named_parameters())
    w = {**mtp, "model.embed_tokens.weight": params["model.embed_tokens.weight"]}
    head = params["lm_head.weight"]
    main_sum, main_n, mtp_sum, mtp_n = 0.0, 0, 0.0, 0
    logprobs = torch.zeros(ids.numel(), dtype=torch.float64)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        hidden = model.model(ids[None, a:b]).last_hidden_state[0]  # (n, H), final-normed
        logp = F.log_softmax(hidden @ head.T, -1)
        main_sum = main_sum - logp[:-1].gather(1, ids[a + 1:b, None]).sum()
        main_n += b - a - 1
        if b - a < 3:
            continue
        y = mtp_hidden(w, c, hidden[:-2], ids[a + 1:b - 1])  # positions with a target t+2
        lp = F.log_softmax(y @ head.T, -1).gather(1, ids[a + 2:b, None])[:, 0]
        logprobs[a:b - 2] = lp.detach()
        mtp_sum = mtp_sum - lp.sum()
        mtp_n += b - a - 2
    main, mtp_loss = main_sum / main_n, mtp_sum / mtp_n
    (main + weight * mtp_loss).backward()
    grads = {n: p.grad.detach().clone() for n, p in params.items()}
    grads.update({n: t.grad.detach().clone() for n, t in mtp.items()})
    return {"main": float(main.detach()), "mtp": float(mtp_loss.detach()), "mtp_logprobs": logprobs,
            "grads": grads, "count": main_n, "mtp_count": mtp_n}
