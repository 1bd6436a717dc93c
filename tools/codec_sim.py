#!/usr/bin/env python3
"""What a row code of the full-attention K/V costs in perplexity, simulated in HF transformers.

The decoder's `--full-attn codec` reads a full-attention position p from coded rows when the query q
is at q - p >= window and p >= sink (exact otherwise). This reproduces that rule inside HF's Gemma 3
(an attention function registered with transformers; sliding layers exact) and scores the
teacher-forced NLL of the last --tail tokens of --context-long prefixes, for several codes side by
side on the same tokens, so a code can be judged before it is built into the kernels:

  lmB          the shipped rotated code (core/kernels/ops.h "Rotated"): randomized Hadamard rotation,
               N(0,1) Lloyd-Max levels of B bits, one scale per row keeping its norm;
  pwB          the rotated code of B bits on w ⊙ (x - mean), read back as decoded / w: per-coordinate
               weights fixed by calibration that shape where the code's (isotropic) error lands. K: the
               error moves a score by q·Δk, so w² = |q|/σ per RoPE pair (q's and k's energy over the pair
               (i, i + D/2), which the rotation of a position leaves unchanged, so far positions keep
               them); V: the error reaches the layer's output through o_proj, so w² = |o_proj column|/σ
               per coordinate. Minimizes (Σ w²σ²)(Σ e/w²) with e the error's weight: the gain over lmB
               is (Σσ²)(Σe)/(Σ σ·sqrt(e))² in distortion.
  calB         a calibrated code: per layer and KV head, the PCA basis of K (V) on --calib text,
               each coordinate scaled by its calibrated deviation and given an integer number of
               bits by greedy reverse water-filling (B·D bits a row), K's coordinates weighted by the
               calibrated query energy along them (an error in k moves the score by q·Δk).

  ruB          the rotated code with 2^B evenly spaced levels (spacing fitted to N(0,1)) instead of Lloyd-Max
               ones: a level is an integer times a step, so a reader decodes with a multiply-add, no table.
  intB         the affine code of restored regions (core/kernels/ops.h "Affine"): groups of 32 values,
               x ≈ min + scale · c with min and scale in f16, c rounded half to even.

A code may give V rows other bits than K rows (`lm5v3`: K in 5, V in 3) and re-code rows once they are
DIST positions behind the query (`lm5/3@2048`: 5 bits, then 3; what a decoder re-coding aging rows reads).

Rows are coded less a mean per head, as the decoder does; --mean says which: `prompt` (every
scored prefix's positions before the tail: the best a session could know) or `first:N` (its first N
positions: the decoder's rule, the means of a session's first forward, N = its prefill chunk) or
`none` (rows coded as they are: what a restored region holds).

--row-error measures the codes where perplexity is too coarse: the relative squared error
|x̂ - x|² / |x|² of every layer's K and V rows as the model caches them (K after its norm and RoPE;
the first document's --context tokens, positions past --sink), per layer and code (int and lm codes).

  .venv/bin/python tools/codec_sim.py --context 4096 --docs data/longeval/docs/00.txt,... \
      --codes exact,lm4,lm3,cal4,cal3 --mean first:256 --json out.json
"""
import argparse, functools, json, math, re, sys, time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_utils import AttentionInterface


def lloyd_max(bits, iters=200):
    """N(0,1) Lloyd-Max levels of `bits` bits (ascending), fitted on a fine grid."""
    g = torch.linspace(-8, 8, 200001, dtype=torch.float64)
    p = torch.exp(-g * g / 2)
    n = 2 ** bits
    lv = torch.linspace(-2.5, 2.5, n, dtype=torch.float64) * (1 + bits / 4)
    for _ in range(iters):
        idx = torch.bucketize(g, (lv[1:] + lv[:-1]) / 2)
        num = torch.zeros(n, dtype=torch.float64).index_add_(0, idx, g * p)
        den = torch.zeros(n, dtype=torch.float64).index_add_(0, idx, p)
        lv = num / den.clamp_min(1e-300)
    return lv.float()


def uniform_levels(bits):
    """2^bits evenly spaced levels, symmetric about 0, whose spacing minimizes the N(0,1) error (ascending)."""
    g = torch.linspace(-8, 8, 200001, dtype=torch.float64)
    p = torch.exp(-g * g / 2)
    n = 2 ** bits
    best = None
    for clip in torch.linspace(1.0, 5.0, 401, dtype=torch.float64):
        lv = (torch.arange(n, dtype=torch.float64) - (n - 1) / 2) * (2 * clip / n)
        e = float((((lv[torch.bucketize(g, (lv[1:] + lv[:-1]) / 2)] - g) ** 2) * p).sum() / p.sum())
        if best is None or e < best[0]:
            best = (e, lv)
    return best[1].float()


LEVELS = {b: lloyd_max(b) for b in range(1, 9)}
UNIFORM = {}


def nearest(u, bits, uniform=False):
    if bits == 0:
        return torch.zeros_like(u)
    if uniform and bits not in UNIFORM:
        UNIFORM[bits] = uniform_levels(bits)
    lv = (UNIFORM if uniform else LEVELS)[bits].to(u.device)
    return lv[torch.bucketize(u.contiguous(), (lv[1:] + lv[:-1]) / 2)]


def fwht(x):
    D = x.shape[-1]
    y, h = x.reshape(-1, D), 1
    while h < D:
        p = y.view(-1, D // (2 * h), 2, h)
        y = torch.stack([p[:, :, 0] + p[:, :, 1], p[:, :, 0] - p[:, :, 1]], 2).view(-1, D)
        h *= 2
    return (y / math.sqrt(D)).view(x.shape)


@functools.lru_cache(maxsize=None)
def signs(D, device):  # ops::rotation_sign, built once per (D, device): rotated() runs per layer, head and code
    return torch.tensor([-1.0 if ((i * 0x9E3779B1) & 0xFFFFFFFF) >> 31 else 1.0 for i in range(D)], device=device)


def rotated(x, bits, uniform=False):
    """The decoded rows of the shipped rotated code (x: [..., D], less its mean); uniform: evenly spaced levels."""
    s = signs(x.shape[-1], x.device)
    y = fwht(s * x)
    n = x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    c = nearest(y * math.sqrt(x.shape[-1]) / n, bits, uniform)
    return s * fwht(c * (n / c.norm(dim=-1, keepdim=True).clamp_min(1e-12)))


def affine(x, bits):
    """The decoded rows of the affine code (x: [..., D], D a multiple of 32)."""
    g = x.reshape(*x.shape[:-1], -1, 32)
    mn = g.amin(-1, keepdim=True).half().float()
    sc = ((g.amax(-1, keepdim=True) - mn) / (2 ** bits - 1)).half().float()
    c = torch.where(sc > 0, torch.round((g - mn) / torch.where(sc > 0, sc, 1)), 0).clamp(0, 2 ** bits - 1)
    return (mn + sc * c).reshape(x.shape)


def allocate(weight, total):
    """Integer bits per coordinate (0..8) for `total` bits: greedy on weight_i · distortion(b_i)."""
    g = torch.randn(200000, generator=torch.Generator().manual_seed(0))
    dist = torch.tensor([1.0] + [float(((g - nearest(g, b)) ** 2).mean()) for b in range(1, 9)] + [0.0])
    bits = torch.zeros(len(weight), dtype=torch.long)
    for _ in range(total):
        gain = weight * (dist[bits] - dist[bits + 1])
        gain[bits >= 8] = -1
        bits[int(gain.argmax())] += 1
    return bits


def calibrated(x, basis, sigma, bits):
    z = x @ basis
    out = torch.zeros_like(z)
    for b in sorted(set(int(t) for t in bits.tolist())):
        sel = bits == b
        out[..., sel] = nearest(z[..., sel] / sigma[sel], b) * sigma[sel]
    return out @ basis.T


# A code: its kind, K rows' bits, V rows' bits (default K's), and optionally the bits F both take
# once a row is DIST positions behind the query (a row re-coded as it ages; F always rotated).
CODE = r"exact|(lm|ru|cal|pw|int)([1-8])(?:v([1-8]))?(?:/([2-8])@([0-9]+))?"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="checkpoints/models/gemma3-270m")
    ap.add_argument("--docs", required=True, help="comma list of text files; each scores its first --context tokens")
    ap.add_argument("--calib", default="data/codec/calib.txt", help="text the calibrated codes are fitted on")
    ap.add_argument("--calib-windows", type=int, default=4, help="windows of --calib")
    ap.add_argument("--calib-context", type=int, default=2048, help="tokens per --calib window")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tail", type=int, default=512)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--codes", default="exact,lm4,lm3,cal4,cal3")
    ap.add_argument("--mean", default="first:256", help="prompt | first:N | none")
    ap.add_argument("--row-error", action="store_true",
                    help="each code's relative error on every layer's K and V rows instead of perplexity")
    ap.add_argument("--pw-power", type=float, default=1.0, help="pw codes: w² = (|q|/σ)^power (1: the optimum)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json")
    a = ap.parse_args()
    codes = a.codes.split(",")
    for c in codes:
        if not re.fullmatch(CODE, c):
            sys.exit(f"codec_sim: --codes: unknown code '{c}' (expected exact | lmK[vV][/F@DIST] | ruK[vV][/F@DIST] | pwK[vV][/F@DIST] | calK[vV][/F@DIST] "
                     "| intK[vV]: K, V bits of K and V rows (lm 2..8, cal 1..8), F bits of both once DIST positions old)")
    if codes[0] != "exact":
        sys.exit("codec_sim: --codes: the list starts with exact (every ratio is to it)")
    if a.mean not in ("prompt", "none") and not (a.mean.startswith("first:") and a.mean[6:].isdigit()):
        sys.exit(f"codec_sim: --mean: expected prompt | first:N | none, got '{a.mean}'")
    if a.row_error and any(re.fullmatch(CODE, c).group(1) not in (None, "lm", "ru", "int") for c in codes):
        sys.exit("codec_sim: --row-error: int, lm and ru codes only (pw and cal are calibrated for full-attention layers)")
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval().to(a.device)
    cfg = model.config

    state = {"code": None, "collect": None}

    def attention(module, q, k, v, mask, dropout=0.0, scaling=None, sliding_window=None, softcap=None, **kw):
        # q: [1, Hq, T, D]; k, v: [1, Hkv, T, D]
        T, rep = q.shape[2], q.shape[1] // k.shape[1]
        pos = torch.arange(T, device=q.device)
        rel = pos[:, None] - pos[None, :]
        vis = rel >= 0
        if module.is_sliding:
            vis &= rel < sliding_window
        elif state["collect"] is not None:
            state["collect"].setdefault(module.layer_idx, []).append((q[0], k[0], v[0]))
        kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = (q @ kr.transpose(-1, -2)) * scaling
        if module.is_sliding or state["code"] is None:
            return (s.masked_fill(~vis, float("-inf")).softmax(-1) @ vr).transpose(1, 2), None
        tiers = state["code"](module.layer_idx, k[0], v[0])  # [(from distance, k, v [Hkv, T, D] decoded rows)]
        reads = []
        for i, (d, kc, vc) in enumerate(tiers):  # tier i: rows d_i <= q - p < d_i+1 (and p >= sink)
            sel = (rel >= d) & (pos[None, :] >= a.sink)
            if i + 1 < len(tiers):
                sel &= rel < tiers[i + 1][0]
            kc, vc = kc[None].repeat_interleave(rep, 1), vc[None].repeat_interleave(rep, 1)
            s = torch.where(sel, (q @ kc.transpose(-1, -2)) * scaling, s)
            reads.append((sel, vc))
        p = s.masked_fill(~vis, float("-inf")).softmax(-1)
        out = p @ vr
        for sel, vc in reads:  # swap the exact values for the coded ones where read coded
            out = out + (p * sel) @ (vc - vr)
        return out.transpose(1, 2), None

    AttentionInterface.register("codec_sim", attention)
    for m in model.modules():
        if hasattr(m, "config"):
            m.config._attn_implementation = "codec_sim"

    def ids_of(path, n, count=1):
        ids = tok(open(path).read(), return_tensors="pt").input_ids[0]
        ids = ids[ids != cfg.bos_token_id]
        out = [torch.cat([torch.tensor([cfg.bos_token_id]), ids[s : s + n - 1]]) for s in range(0, len(ids) - n + 2, n - 1)]
        if not out:
            sys.exit(f"codec_sim: {path}: {len(ids)} tokens, fewer than --context {n}")
        return out[:count]

    # Calibration (pw and cal codes): the full-attention layers' q, k, v on --calib text.
    state["collect"] = {}
    if any(re.fullmatch(CODE, c).group(1) in ("pw", "cal") for c in codes):
        with torch.no_grad():
            for ids in ids_of(a.calib, a.calib_context, a.calib_windows):
                model(ids[None].to(a.device))
    cal, pw = {}, {}
    attn_of = {m.layer_idx: m for m in model.modules() if hasattr(m, "o_proj") and hasattr(m, "layer_idx")}
    for li, rows in state["collect"].items():
        q = torch.cat([r[0] for r in rows], 1)  # [Hq, N, D]
        k = torch.cat([r[1] for r in rows], 1)  # [Hkv, N, D]
        v = torch.cat([r[2] for r in rows], 1)
        rep = q.shape[0] // k.shape[0]
        for h in range(k.shape[0]):
            qh = q[h * rep : (h + 1) * rep].reshape(-1, q.shape[-1])
            for name, x in (("k", k[h]), ("v", v[h])):
                xc = x - x.mean(0)
                ev, U = torch.linalg.eigh(xc.T @ xc / len(xc))
                U, ev = U.flip(1), ev.flip(0).clamp_min(1e-12)
                energy = ((qh @ U) ** 2).mean(0) if name == "k" else torch.ones_like(ev)
                cal[li, h, name] = (U, ev.sqrt(), (ev * energy).cpu())
                # pw: per-coordinate weights (K: RoPE pairs; V: o_proj column energy)
                D = x.shape[-1]
                var = (xc ** 2).mean(0)
                if name == "k":
                    var = var.view(2, D // 2).mean(0).repeat(2)
                    e = (qh ** 2).mean(0).view(2, D // 2).mean(0).repeat(2)
                else:
                    W = attn_of[li].o_proj.weight  # [hidden, Hq·D]; the head group of KV head h
                    e = sum((W[:, (h * rep + j) * D : (h * rep + j + 1) * D] ** 2).sum(0) for j in range(rep))
                var, e = var.clamp_min(1e-12), e.clamp_min(1e-12)
                w = (e / var) ** (0.25 * a.pw_power)  # the optimum at --pw-power 1
                pw[li, h, name] = w / w.pow(2).mean().sqrt()
                gain = float(var.sum() * e.sum() / (var.sqrt() * e.sqrt()).sum() ** 2)
                print(f"calib layer {li} head {h} {name}: pw distortion gain over lm {gain:.3f} "
                      f"({0.5 * math.log2(gain):.2f} bits)", flush=True)
    state["collect"] = None
    allocs = {}

    def code_fn(code):
        kind, kb, vb, fb, dist = re.fullmatch(CODE, code).groups()
        bits = {"k": int(kb), "v": int(vb or kb)}

        def run(li, k, v):
            T = k.shape[1]
            end = T - a.tail if a.mean == "prompt" else a.sink if a.mean == "none" else int(a.mean[6:])
            out = {"k": [], "v": [], "kfar": [], "vfar": []}
            for h in range(k.shape[0]):
                for name, x in (("k", k[h]), ("v", v[h])):
                    m = x[a.sink : end].mean(0) if end > a.sink else torch.zeros_like(x[0])
                    b = bits[name]
                    if kind == "int":
                        xh = affine(x - m, b)
                    elif kind in ("lm", "ru"):
                        xh = rotated(x - m, b, kind == "ru")
                    elif kind == "pw":
                        w = pw[li, h, name]
                        xh = rotated(w * (x - m), b) / w
                    else:
                        U, sig, w = cal[li, h, name]
                        if (li, h, name, b) not in allocs:
                            allocs[li, h, name, b] = allocate(w, b * x.shape[-1])
                        xh = calibrated(x - m, U, sig, allocs[li, h, name, b].to(x.device))
                    out[name].append(xh + m)
                    if fb:
                        out[name + "far"].append(rotated(x - m, int(fb)) + m)
            tiers = [(a.window, torch.stack(out["k"]), torch.stack(out["v"]))]
            if fb:
                tiers.append((int(dist), torch.stack(out["kfar"]), torch.stack(out["vfar"])))
            return tiers

        return run

    docs = [ids_of(p, a.context)[0] for p in a.docs.split(",")]
    if a.row_error:
        row_error(a, model, docs[0], codes[1:], code_fn)
        return
    report = {"command": " ".join(sys.argv), "context": a.context, "tail": a.tail, "window": a.window, "sink": a.sink,
              "mean": a.mean, "docs": a.docs.split(","), "codes": {}}
    base = None
    for code in codes:
        state["code"] = None if code == "exact" else code_fn(code)
        t0 = time.time()
        nll = []
        with torch.no_grad():
            for ids in docs:
                ids = ids.to(a.device)  # logits of the scored tail only (a 16k prefix's are 17 GB)
                lp = model(ids[None], logits_to_keep=a.tail + 1).logits[0, :-1].float().log_softmax(-1)
                nll.append(-lp.gather(1, ids[-a.tail :, None]).mean().item())
        if base is None:
            base = nll
        ratios = [math.exp(x - b) for x, b in zip(nll, base)]
        mean_ratio = math.exp(sum(nll) / len(nll) - sum(base) / len(base))
        report["codes"][code] = {"nll": nll, "ppl": math.exp(sum(nll) / len(nll)), "ratio_per_doc": ratios,
                                 "ppl_ratio": mean_ratio}
        print(f"{code:6s} ppl {math.exp(sum(nll) / len(nll)):8.4f}  vs exact {mean_ratio:.4f}  per doc "
              + " ".join(f"{r:.4f}" for r in ratios) + f"  ({time.time() - t0:.0f} s)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


def row_error(a, model, ids, codes, code_fn):
    """Relative error of each code on every layer's cached K and V rows (positions >= --sink)."""
    with torch.no_grad():
        cache = model(ids[None].to(a.device), use_cache=True).past_key_values
    types = model.config.get_text_config().layer_types
    report = {"command": " ".join(sys.argv), "context": a.context, "sink": a.sink, "mean": a.mean, "doc": a.docs.split(",")[0],
              "layers": []}
    print("layer type     " + " ".join(f"{c + ' ' + n:>9s}" for n in ("K", "V") for c in codes), flush=True)
    for li, layer in enumerate(cache.layers):
        k, v = layer.keys[0].float(), layer.values[0].float()  # [Hkv, T, D]
        row = {"layer": li, "type": types[li], "k": {}, "v": {}}
        for code in codes:
            (_, kc, vc), = code_fn(code)(li, k, v)  # one tier: decoded rows of every position
            for name, x, xh in (("k", k, kc), ("v", v, vc)):
                x, xh = x[:, a.sink :], xh[:, a.sink :]
                row[name][code] = float(((xh - x) ** 2).sum() / (x ** 2).sum())
        report["layers"].append(row)
        print(f"{li:5d} {types[li].replace('_attention', ''):8s} " + " ".join(f"{row[n][c]:9.5f}" for n in ("k", "v") for c in codes), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
