"""The f_θ losses in plain PyTorch, written from the definitions in
train/ftheta_loss.h with HF transformers' Gemma 3 modules (q_norm, k_norm,
rotary embedding, apply_rotary_pos_emb, o_proj). Two users:
  tests/fixtures/make_ftheta_fixtures.py  reference values and gradients for tests/test_ftheta.cpp
  tools/ftheta_step_ref.py                the PyTorch eager step `kakeya bench train-ftheta` times

No host syncs (boolean masks are used as weights, not as indices), so a timed
step on CUDA is not slowed by anything our C++ step does not also do.
"""
import torch
import torch.nn.functional as F
from transformers.models.gemma3.modeling_gemma3 import apply_rotary_pos_emb

STATS = ["attn", "attn_ratio", "k_dir", "v_dir", "k_mag", "v_mag", "k_cos", "v_cos", "k_mse", "v_mse", "k_rel_mse",
         "v_rel_mse"]


def cosine(a, b):
    return (a * b).sum(-1) * torch.rsqrt(torch.clamp_min((a * a).sum(-1) * (b * b).sum(-1), 1e-16))


def predict(W, dk, dv, kv_dims, H, D):
    """f_θ (core/model/ftheta.h): per position the drafter layers' K (V) flattened -> encoder -> fused decoders.
    dk, dv: [B, T, L_d, H_d, D_d] -> per verifier layer (K, V) [B, T, H, D]."""
    B, T = dk.shape[:2]
    yk = F.linear(F.linear(dk.flatten(-3), W["k.encoder.weight"], W["k.encoder.bias"]), W["k.decoder.weight"],
                  W["k.decoder.bias"])
    yv = F.linear(F.linear(dv.flatten(-3), W["v.encoder.weight"], W["v.encoder.bias"]), W["v.decoder.weight"],
                  W["v.decoder.bias"])
    out, off = [], 0
    for n in kv_dims:
        out.append((yk[..., off:off + n].reshape(B, T, H, D), yv[..., off:off + n].reshape(B, T, H, D)))
        off += n
    return out


def rope(model, x, pos, layer_type):
    # x: [B, H, T, D]
    cos, sin = model.model.rotary_emb(x, pos[None], layer_type)
    return apply_rotary_pos_emb(x, x, cos, sin)[0]


def layer_output(model, cfg, l, q_raw, ke, ve, kp, vp, pos, sink, window, sdpa=False):
    """Attention output after o_proj [B, T, hidden] for the restored layout, and the query weights Q_l [T]
    (1 for queries that see a predicted key). sdpa: one scaled_dot_product_attention over [exact ++ predicted]
    keys with a boolean mask (as the seeds' prototype did); else explicit scores and softmax."""
    attn = model.model.layers[l].self_attn
    lt = cfg.layer_types[l]
    B, T = q_raw.shape[:2]
    G = cfg.num_attention_heads // cfg.num_key_value_heads
    q = rope(model, attn.q_norm(q_raw).transpose(1, 2), pos, lt)  # [B, Hq, T, D]

    def keys(k, v):
        k = rope(model, attn.k_norm(k).transpose(1, 2), pos, lt).repeat_interleave(G, 1)
        return k, v.transpose(1, 2).repeat_interleave(G, 1)  # Gemma 3: no v_norm

    t, j = pos[:, None], pos[None, :]
    vis = j <= t
    if lt == "sliding_attention":
        vis = vis & (t - j < cfg.sliding_window)
    exact = (j < sink) | (t - j < window)
    groups = [(kp, vp, vis & ~exact)] if sink == 0 and window == 0 else [(ke, ve, vis & exact), (kp, vp, vis & ~exact)]
    if sdpa:
        assert not cfg.attn_logit_softcapping, "sdpa has no logit softcap"
        kv = [keys(k, v) for k, v, _ in groups]
        k_all, v_all = torch.cat([k for k, _ in kv], -2), torch.cat([v for _, v in kv], -2)
        mask = torch.cat([m for _, _, m in groups], -1)
        o = F.scaled_dot_product_attention(q, k_all.to(q.dtype), v_all.to(q.dtype), attn_mask=mask,
                                           scale=attn.scaling)
    else:
        scores, values = [], []
        for k, v, m in groups:
            k, v = keys(k, v)
            s = q @ k.transpose(-1, -2) * attn.scaling
            if cfg.attn_logit_softcapping:
                s = torch.tanh(s / cfg.attn_logit_softcapping) * cfg.attn_logit_softcapping
            scores.append(s.masked_fill(~m, float("-inf")))
            values.append(v)
        p = torch.softmax(torch.cat(scores, -1).float(), -1)
        o = p.to(values[0].dtype) @ torch.cat(values, -2)
    o = o.transpose(1, 2).reshape(B, T, -1)
    return attn.o_proj(o), (vis & ~exact).any(-1).float()


def loss_case(model, cfg, W, d, case, sdpa=False):
    """The loss `case["loss"]` (mse | cos_mag | combined | attn_distill | attn_distill_hybrid) and the
    per-layer stats [L, len(STATS)] on batch d (positions, dk, dv, q.l, k.l, v.l, o.l)."""
    L = cfg.num_hidden_layers
    H, D = cfg.num_key_value_heads, cfg.head_dim
    pred = predict(W, d["dk"], d["dv"], [H * D] * L, H, D)
    layers = case.get("layers", list(range(L)))
    lkd, lvd, lkm, lvm = case.get("lambdas", [1.0, 1.0, 0.1, 0.1])
    pos = d["positions"]
    B = d["dk"].shape[0]
    wp = (pos >= case["sink"]).float()[None, :, None]  # P as weights over per-vector terms [B, T, H]
    n_vec = torch.clamp_min(wp.sum() * B * H, 1.0)
    stats = torch.zeros(L, len(STATS), device=pos.device)
    kind = case["loss"]
    total = 0.0

    def mean_p(x):  # x: [B, T, H] per-vector values -> mean over P
        return (x * wp).sum() / n_vec

    def mag(p, t):
        n_p, n_t = torch.linalg.vector_norm(p, dim=-1), torch.linalg.vector_norm(t, dim=-1)
        return ((n_p - n_t) ** 2 * wp).sum() / torch.clamp_min((n_t ** 2 * wp).sum(), 1e-30)

    for l in layers:
        attn = model.model.layers[l].self_attn
        kp, vp = (x.float() for x in pred[l])
        kt, vt = d[f"k.{l}"].float(), d[f"v.{l}"].float()
        k_mse, v_mse = mean_p(((kp - kt) ** 2).sum(-1)) / D, mean_p(((vp - vt) ** 2).sum(-1)) / D
        k_cos, v_cos = mean_p(cosine(kp, kt)), mean_p(cosine(vp, vt))
        k_mag, v_mag = mag(kp, kt), mag(vp, vt)
        k_dir = mean_p(1 - cosine(attn.k_norm(kp), attn.k_norm(kt)))
        v_dir = mean_p(1 - cosine(vp, vt))  # Gemma 3 has no v_norm
        k_rel = (((kp - kt) ** 2).sum(-1) * wp).sum() / torch.clamp_min(((kt ** 2).sum(-1) * wp).sum(), 1e-30)
        v_rel = (((vp - vt) ** 2).sum(-1) * wp).sum() / torch.clamp_min(((vt ** 2).sum(-1) * wp).sum(), 1e-30)
        a = ratio = torch.zeros((), device=pos.device)
        if kind.startswith("attn_distill"):  # only the attention losses recompute attention
            o, wq = layer_output(model, cfg, l, d[f"q.{l}"], kt, vt, kp, vp, pos, case["sink"], case["window"], sdpa)
            ot = d[f"o.{l}"].float()
            n_q = torch.clamp_min(wq.sum() * B * ot.shape[-1], 1.0)
            a = (((o.float() - ot) ** 2).sum(-1) * wq).sum() / n_q
            ratio = a / torch.clamp_min(((ot ** 2).sum(-1) * wq).sum() / n_q, 1e-30)
        vals = dict(attn=a, attn_ratio=ratio, k_dir=k_dir, v_dir=v_dir, k_mag=k_mag, v_mag=v_mag, k_cos=k_cos,
                    v_cos=v_cos, k_mse=k_mse, v_mse=v_mse, k_rel_mse=k_rel, v_rel_mse=v_rel)
        stats[l] = torch.stack([vals[s].detach().float() for s in STATS])
        if kind == "mse":
            total = total + k_mse + v_mse
        elif kind in ("cos_mag", "combined"):
            total = total + (1 - k_cos) + k_mag + (1 - v_cos) + v_mag
            if kind == "combined":
                total = total + 0.1 * (k_mse + v_mse)
        elif kind == "attn_distill":
            total = total + a
        else:
            total = total + a + lkd * k_dir + lvd * v_dir + lkm * k_mag + lvm * v_mag
    return total / len(layers), stats
