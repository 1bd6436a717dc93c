#!/usr/bin/env python3
"""How much of the verifier's per-layer K/V can ANY linear f_θ recover from a given input?

f_θ (core/model/ftheta.h) maps the drafter's raw context K (K path) / raw context V (V path)
at a position to the verifier's raw K/V of every layer at that position, through a
shared rank-256 bottleneck per path. It is a linear (affine) map, so the best it can
ever do on squared error is closed-form ridge regression; with the bottleneck, the
best is reduced-rank ridge regression. This tool measures that optimum on held-out
text for several candidate inputs, all computed from one Gemma 3 270M forward (HF
transformers, f32, CPU) and the shipped DFlash drafter's weights (upcast to f32):

  a  drafter raw K -> verifier K, drafter raw V -> verifier V   (today's f_θ input; 5 x 64 each)
  b  drafter raw K ++ raw V (640) -> K and V
  c  the drafter context c = hidden_norm(fc(target features)) (640) -> K and V
  d  the target features: verifier hidden states at the drafter's target layers
     (outputs of decoder layers 1,4,8,12,15 = HF hidden_states[i+1]), each RMS-normalised
     per position without weight, concatenated (5 x 640 = 3200) -> K and V
  e  d ++ gelu(d R) (R: fixed random Gaussian, --rf-dim columns) ++ log rms of each
     target layer: a cheap nonlinear feature (--rf-dim 0 disables)

Targets: every verifier layer's raw K (k_proj output: before k_norm and RoPE) and raw V
(v_proj output), from forward hooks. Errors are relative MSE  Σ‖pred-true‖² / Σ‖true‖²
per layer, on positions >= --skip (the attention sinks stay exact in restoration),
in raw space and in cache space (K after the layer's own k_norm; Gemma 3 has no v_norm,
so V's cache space is its raw space), averaged over the sliding-attention layers.

Fit: ridge on standardised features with lambda (relative to unit feature variance)
chosen per path on a held-out split of the fit data (same text kinds), then refit on
all fit data. Rank 256: the ridge map projected onto the top-256 principal subspace of
its fitted values (targets weighted per layer by 1/rms, so that the subspace minimises
the sum of per-layer relative errors, the reported metric). Evaluation text is of
kinds the fit never saw (default: the GPL-3 text and apt's Debian changelog).

Also: "dirfit" (K cache space) fits the K path to the per-layer unit-RMS direction of K
(k_norm discards the scale, so this is the best linear fit for cache space); "non-exact"
averages only the sliding layers whose input is NOT a target-layer output (on layers
2,5,9,13,16 raw K/V are exactly linear in input d); a rank sweep (--sweep-ranks) gives
the target-PCA floor and the d ridge map at other bottleneck widths.

--side-code k1,k2,...: what f_θ plus k numbers a position and path, stored when the position leaves the
window (its exact K/V still known), could reach: input d's full-rank ridge map plus the projection of its
residual on the top-k principal directions of the fit residual, on the layers a restored decode takes from
f_θ (sliding, not a target layer's successor, not layer 0).

Reference rows: "mean" predicts the fit-data mean; "shipped f_θ" is
checkpoints/gemma3-270m/ftheta on input a; "pca256 of target" is the error of the
best rank-256 reconstruction of the TRUE targets (fit-data basis, same weighting): the
floor any rank-256 bottleneck hits, whatever its input; "verifier proj prev|next" runs
verifier layer l's own input_layernorm + k_proj/v_proj on the nearest target-layer hidden
state before layer l (prev; exact where l-1 is a target layer) or at/after it (next).

  .venv/bin/python tools/ftheta_capacity.py \
      --json bench/results/2026-11-25-ftheta-capacity-cpu.json

(444 s on the 2-core dev CPU with the defaults: 24 x 1024 fit tokens, 8 x 1024 eval, one
torch thread; --rf-dim 0 drops option e and ~100 s. More threads only help on an idle
machine: MKL's LAPACK spins under contention, so qr/eigh always run single-threaded.)
"""
import argparse, glob, gzip, json, math, os, subprocess, sys, time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / ".venv/lib/python3.11/site-packages"
DEF_FIT = [
    "/usr/lib/python3.11/email/*.py,/usr/lib/python3.11/json/*.py,/usr/lib/python3.11/http/*.py",
    ",".join(str(SITE / f"{p}-*.dist-info/METADATA") for p in ["transformers", "torch", "datasets", "tqdm", "psutil"]),
]
DEF_EVAL = ["/usr/share/common-licenses/GPL-3", "/usr/share/doc/apt/changelog.gz"]


def read_text(p):
    if p.endswith(".gz"):
        with gzip.open(p, "rt", encoding="utf-8", errors="replace") as f:
            return f.read()
    with open(p, encoding="utf-8", errors="replace") as f:
        return f.read()


def source_files(spec):
    files = []
    for g in spec.split(","):
        m = sorted(glob.glob(g))
        if not m:
            sys.exit(f"ftheta_capacity: no file matches {g}")
        files += m
    return files


def make_seqs(tok, specs, n_tokens, seq_len, bos):
    """Per source spec an equal share of n_tokens, as consecutive chunks of seq_len-1 tokens
    of the concatenated files, each prefixed with BOS; interleaved round-robin."""
    per = max(1, round(n_tokens / seq_len / len(specs)))
    out = []  # (source index, ids)
    for si, spec in enumerate(specs):
        files = source_files(spec)
        ids = tok.encode("\n\n".join(read_text(f) for f in files), add_special_tokens=False).ids
        n = min(per, len(ids) // (seq_len - 1))
        if n < per:
            print(f"warning: source {si} has only {len(ids)} tokens: {n} sequences, not {per}", file=sys.stderr)
        out.append([(si, [bos] + ids[i * (seq_len - 1):(i + 1) * (seq_len - 1)]) for i in range(n)])
    inter = []
    for i in range(max(len(o) for o in out)):
        inter += [o[i] for o in out if i < len(o)]
    return inter, [{"spec": s, "files": source_files(s), "sequences": len(o)} for s, o in zip(specs, out)]


@torch.no_grad()
def capture(model, seqs, tids, skip):
    """-> H [N, n·640] raw target-layer outputs, K [N, L·256], V [N, L·256] (positions >= skip)."""
    layers = model.model.layers
    cap = {}
    hooks = []
    for i, lay in enumerate(layers):
        hooks.append(lay.self_attn.k_proj.register_forward_hook(lambda m, a, o, i=i: cap.__setitem__(("k", i), o)))
        hooks.append(lay.self_attn.v_proj.register_forward_hook(lambda m, a, o, i=i: cap.__setitem__(("v", i), o)))
    Hs, Ks, Vs = [], [], []
    t0 = time.time()
    for n, (_, ids) in enumerate(seqs):
        out = model.model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
        hs = out.hidden_states
        Hs.append(torch.cat([hs[t + 1][0, skip:] for t in tids], -1))
        Ks.append(torch.cat([cap[("k", i)][0, skip:] for i in range(len(layers))], -1))
        Vs.append(torch.cat([cap[("v", i)][0, skip:] for i in range(len(layers))], -1))
        cap.clear()
        print(f"  forward {n + 1}/{len(seqs)}  {time.time() - t0:.0f}s", end="\r", file=sys.stderr)
    print(file=sys.stderr)
    for h in hooks:
        h.remove()
    return torch.cat(Hs), torch.cat(Ks), torch.cat(Vs)


def rms_norm_noweight(x, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class Drafter:
    def __init__(self, d):
        w = {k: v.float() for k, v in load_file(str(Path(d) / "model.safetensors")).items()}
        cfg = json.load(open(Path(d) / "config.json"))
        self.eps = cfg.get("rms_norm_eps", 1e-6)
        self.tids = cfg.get("dflash_config", {}).get("target_layer_ids") or cfg["target_layer_ids"]
        self.fc, self.hn = w["fc.weight"], w["hidden_norm.weight"]
        L = cfg["num_hidden_layers"]
        self.wk = torch.cat([w[f"layers.{l}.self_attn.k_proj.weight"] for l in range(L)])  # [L·64, 640]
        self.wv = torch.cat([w[f"layers.{l}.self_attn.v_proj.weight"] for l in range(L)])

    def context(self, H):
        return self.hn * rms_norm_noweight(H @ self.fc.T, self.eps)


def features(opt, H, dr, n_t, rf):
    N = H.shape[0]
    if opt in ("a_k", "a_v", "b", "c"):
        c = dr.context(H)
        if opt == "c":
            return c
        dk, dv = c @ dr.wk.T, c @ dr.wv.T
        return {"a_k": dk, "a_v": dv, "b": torch.cat([dk, dv], -1)}[opt]
    Hb = H.view(N, n_t, -1)
    rms = Hb.pow(2).mean(-1, keepdim=True).sqrt()
    d = (Hb / (rms + 1e-6)).reshape(N, -1)
    if opt == "d":
        return d
    return torch.cat([d, F.gelu(d @ rf), rms.squeeze(-1).log()], -1)


def chunked_mm(X, W, rows=4096):
    return torch.cat([X[i:i + rows] @ W for i in range(0, X.shape[0], rows)])


class one_thread:
    """MKL's LAPACK (qr, eigh) spin-waits badly with 2 threads on a busy 2-core machine
    (eigh 320x320: 3.5 s vs 7 ms): run those single-threaded."""

    def __enter__(self):
        self.n = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.n)


class Stats:
    """Sufficient statistics of (Z, Y) rows for ridge with an intercept: n, Σz, Σy, ZᵀZ, ZᵀY (f64)."""

    def __init__(self, Z, Y):
        self.n = Z.shape[0]
        self.sz, self.sy = Z.double().sum(0), Y.double().sum(0)
        self.zz, self.zy = (Z.T @ Z).double(), (Z.T @ Y).double()

    def __add__(self, o):
        r = Stats.__new__(Stats)
        r.n, r.sz, r.sy, r.zz, r.zy = self.n + o.n, self.sz + o.sz, self.sy + o.sy, self.zz + o.zz, self.zy + o.zy
        return r

    def with_targets(self, Z, Y):
        """The same rows (Z as given to build self) with other targets Y."""
        r = Stats.__new__(Stats)
        r.n, r.sz, r.zz = self.n, self.sz, self.zz
        r.sy, r.zy = Y.double().sum(0), (Z.T @ Y).double()
        return r

    def centred(self):
        mz, my = self.sz / self.n, self.sy / self.n
        return self.zz / self.n - torch.outer(mz, mz), self.zy / self.n - torch.outer(mz, my), mz, my

    def solve(self, alphas, cols=None):
        """-> {alpha: (W [d, m] f32, b [m] f32)} minimising mean ‖y - Wᵀz - b‖² + alpha‖W‖²."""
        A, C, mz, my = self.centred()
        if cols is not None:
            C, my = C[:, cols], my[cols]
        eye = torch.eye(A.shape[0], dtype=torch.float64)
        out = {}
        for a in alphas:
            W = torch.cholesky_solve(C, torch.linalg.cholesky(A + a * eye))
            out[a] = (W.float(), (my - mz @ W).float())
        return out

    def fitted_factor(self):
        """R with RᵀR = centred ZᵀZ / n (fitted-value Gram of W is (RW)ᵀ(RW))."""
        A = self.centred()[0]
        eye = A.diagonal().mean() * torch.eye(A.shape[0], dtype=torch.float64)
        for jitter in (1e-9, 1e-7, 1e-5, 1e-3):  # collinear inputs (b: raw K++V of a 640-dim c)
            Lc, info = torch.linalg.cholesky_ex(A + jitter * eye)
            if info == 0:
                return Lc.T.float()
        raise RuntimeError("fitted_factor: Gram not positive definite")


def layer_rel(pred, true, L, D):
    """per-layer Σ‖pred-true‖² / Σ‖true‖², pred/true [N, L·D]."""
    e = (pred - true).view(-1, L, D).pow(2).sum((0, 2))
    t = true.view(-1, L, D).pow(2).sum((0, 2))
    return (e / t).tolist()


def k_cache(model, Kraw, L, D):
    """K after every layer's own k_norm (Gemma3RMSNorm: x / rms(x) · (1 + w), in f32), all layers at once."""
    if not hasattr(model, "_kn_scale"):
        model._kn_scale = torch.stack([1.0 + model.model.layers[l].self_attn.k_norm.weight.detach().float()
                                       for l in range(L)])  # [L, D]
        model._kn_eps = model.model.layers[0].self_attn.k_norm.eps
    x = Kraw.view(-1, L, D)
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model._kn_eps) * model._kn_scale).view(-1, L * D)


def top_subspace(apply, m, r, iters=10, over=64, seed=0):
    """Top-r eigenvectors of a PSD operator M [m, m] given as apply(Q) = M Q, by subspace
    iteration + Rayleigh-Ritz (f32 products, f64 small eigh)."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, r + over)
    with one_thread():
        Q = torch.linalg.qr(torch.randn(m, k, generator=g))[0]
    for _ in range(iters):
        MQ = apply(Q)
        with one_thread():
            Q = torch.linalg.qr(MQ)[0]
    T = (Q.T @ apply(Q)).double()
    with one_thread():
        ev, U = torch.linalg.eigh(T)
    return Q @ U[:, -r:].float()


def eig_desc(M):
    """All eigenvectors of a PSD M, by decreasing eigenvalue (f32 eigh, one thread)."""
    with one_thread():
        ev, U = torch.linalg.eigh(M.float())
    return U.flip(1)


def gram_op(G):
    """apply for M = GᵀG."""
    return lambda Q: G.T @ (G @ Q)


def write_report(path, script, fields):
    """The JSON report of a CPU measurement tool: its command, the commit, whether the tool differs from it, then fields."""
    rel = os.path.relpath(script, ROOT)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", rel], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out = {"command": "python " + " ".join([rel] + sys.argv[1:]), "commit": commit, "tool_differs_from_commit": bool(dirty),
           "device": "CPU", "dtype": "f32", **fields}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "checkpoints/models/gemma3-270m"))
    ap.add_argument("--drafter", default=str(ROOT / "checkpoints/gemma3-270m/drafter"))
    ap.add_argument("--ftheta", default=str(ROOT / "checkpoints/gemma3-270m/ftheta"), help="'' to skip")
    ap.add_argument("--fit", action="append", default=None,
                    help="fit source: comma-separated globs (repeatable; default: stdlib Python code, package READMEs)")
    ap.add_argument("--eval", action="append", default=None,
                    help="eval source: comma-separated globs, .gz read (repeatable; default: GPL-3, apt changelog)")
    ap.add_argument("--fit-tokens", type=int, default=24 * 1024)
    ap.add_argument("--eval-tokens", type=int, default=8 * 1024)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--skip", type=int, default=4, help="positions < skip are left out (sinks)")
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--sweep-ranks", default="64,128,512,1024",
                    help="extra bottleneck ranks for the target-PCA floor and the --sweep-inputs ridge maps")
    ap.add_argument("--sweep-inputs", default="d", help="comma-separated inputs among b,c,d,e to rank-sweep")
    ap.add_argument("--val-seqs", type=int, default=2, help="per fit source, sequences held out to choose lambda")
    ap.add_argument("--alphas", default="1e-4,1e-2,1e-1,1")
    ap.add_argument("--rf-dim", type=int, default=1024, help="random gelu features of option e (0: no option e)")
    def widths(v):
        try:
            ks = sorted(int(k) for k in v.split(",") if k)
        except ValueError:
            ks = [-1]
        if any(k < 1 for k in ks):
            raise argparse.ArgumentTypeError(f"expected comma-separated widths >= 1, got '{v}'")
        return ks

    ap.add_argument("--side-code", type=widths, default=[],
                    help="comma-separated widths k: also the error of input d's full-rank ridge map plus a k-wide "
                         "side code per path (the top-k principal directions of its fit residual on the layers "
                         "a restored decode takes from f_theta), e.g. 16,32,64,128")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.ftheta and not (Path(a.ftheta) / "f_theta_config.json").is_file():
        ap.error(f"--ftheta {a.ftheta}: no f_theta_config.json there ('' leaves the shipped-f_theta row out)")
    ftheta_input = json.load(open(Path(a.ftheta) / "f_theta_config.json"))["input"]["kind"] if a.ftheta else None
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    t_start = time.time()
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    cfg = json.load(open(Path(a.model) / "config.json"))
    L, D = cfg["num_hidden_layers"], cfg["head_dim"]
    assert cfg["num_key_value_heads"] == 1, "one KV head assumed (Gemma 3 270M)"
    sliding = [i for i, t in enumerate(cfg["layer_types"]) if t == "sliding_attention"]
    tok = Tokenizer.from_file(str(Path(a.model) / "tokenizer.json"))
    bos = cfg.get("bos_token_id", 2)
    fit_specs, eval_specs = a.fit or DEF_FIT, a.eval or DEF_EVAL
    fit_seqs, fit_desc = make_seqs(tok, fit_specs, a.fit_tokens, a.seq_len, bos)
    eval_seqs, eval_desc = make_seqs(tok, eval_specs, a.eval_tokens, a.seq_len, bos)
    # validation split (choose lambda): the last val_seqs sequences of every fit source
    counts = {}
    pos_in_src = []
    for si, _ in fit_seqs:
        pos_in_src.append(counts.get(si, 0))
        counts[si] = counts.get(si, 0) + 1
    is_val = torch.tensor([p >= counts[si] - a.val_seqs for (si, _), p in zip(fit_seqs, pos_in_src)])

    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    dr = Drafter(a.drafter)
    tids = dr.tids
    # sliding layers whose input is NOT a target-layer output (layer l-1 not a target layer):
    # on the others, raw K/V are exactly linear in the RMS-normalised target features (input d)
    nonexact = [l for l in sliding if (l - 1) not in tids]
    print(f"fit {len(fit_seqs)} x {a.seq_len} tokens ({int(is_val.sum())} for lambda), eval {len(eval_seqs)} x {a.seq_len}",
          file=sys.stderr)
    Hf, Kf, Vf = capture(model, fit_seqs, tids, a.skip)
    He, Ke, Ve = capture(model, eval_seqs, tids, a.skip)
    T = a.seq_len - a.skip
    rowval = is_val.repeat_interleave(T)
    t_cap = time.time() - t_start
    print(f"captured fit {Hf.shape[0]} rows, eval {He.shape[0]} rows in {t_cap:.0f}s", file=sys.stderr)

    Yf = torch.cat([Kf, Vf], -1)  # [N, 2·L·D]
    LD = L * D
    Ke_c = k_cache(model, Ke, L, D)
    # per-layer weights 1/rms (uncentred: the metric's denominator) for the rank constraint
    s = Yf.view(-1, 2 * L, D).pow(2).sum(-1).mean(0).rsqrt().repeat_interleave(D)  # [2·L·D]

    results = {}

    def record(name, Kp, Vp, val=None, extra=None):
        kr, vr = layer_rel(Kp, Ke, L, D), layer_rel(Vp, Ve, L, D)
        kc = layer_rel(k_cache(model, Kp, L, D), Ke_c, L, D)
        sm = lambda x: sum(x[i] for i in sliding) / len(sliding)
        sn = lambda x: sum(x[i] for i in nonexact) / len(nonexact)
        r = {"k_raw": sm(kr), "v_raw": sm(vr), "k_cache": sm(kc), "v_cache": sm(vr),
             "k_raw_nonexact": sn(kr), "v_raw_nonexact": sn(vr),
             "per_layer": {"k_raw": kr, "v_raw": vr, "k_cache": kc}}
        if val is not None:
            r["val_same_kinds"] = val
        if extra:
            r.update(extra)
        results[name] = r
        print(f"  {name:34s} K raw {r['k_raw']:.4f}  V {r['v_raw']:.4f}  K cache {r['k_cache']:.4f}"
              f"   ({time.time() - t_start:.0f}s)", file=sys.stderr)

    # ---- references -------------------------------------------------------------------
    mu = Yf.mean(0)
    record("mean", mu[:LD].expand_as(Ke), mu[LD:].expand_as(Ve))
    ranks = sorted(set([int(r) for r in a.sweep_ranks.split(",") if r] + [a.rank]))
    sweep = {"ranks": ranks}

    def rank_sweep(name, U, centred_eval, base):
        """U [2][LD, LD] eigenvectors (desc) per path; centred_eval [2] weighted centred predictions."""
        out = {}
        for r in ranks:
            e = {}
            for pi, (key, true) in enumerate((("k_raw", Ke), ("v_raw", Ve))):
                sl = slice(pi * LD, (pi + 1) * LD)
                pred = base[pi] + (centred_eval[pi] @ U[pi][:, :r]) @ U[pi][:, :r].T / s[sl]
                e[key] = sum(layer_rel(pred, true, L, D)[i] for i in sliding) / len(sliding)
            out[str(r)] = e
        sweep[name] = out
        print(f"  rank sweep {name}: " + "  ".join(f"{r}: {v['k_raw']:.3f}/{v['v_raw']:.3f}" for r, v in out.items()),
              file=sys.stderr)

    # best rank-r reconstruction of the true targets: PCA of the weighted, centred fit targets
    U = []
    for sl in (slice(0, LD), slice(LD, 2 * LD)):
        Yc = (Yf[:, sl] - mu[sl]) * s[sl]
        U.append(eig_desc(Yc.T @ Yc))
        del Yc
    ce = [(Ke - mu[:LD]) * s[:LD], (Ve - mu[LD:]) * s[LD:]]
    rank_sweep("target pca (floor)", U, ce, [mu[:LD], mu[LD:]])
    Kp = mu[:LD] + (ce[0] @ U[0][:, :a.rank]) @ U[0][:, :a.rank].T / s[:LD]
    Vp = mu[LD:] + (ce[1] @ U[1][:, :a.rank]) @ U[1][:, :a.rank].T / s[LD:]
    del U, ce
    record(f"pca{a.rank} of target (floor)", Kp, Vp)
    # verifier's own projection of the nearest target-layer hidden state
    He_b = He.view(He.shape[0], len(tids), -1)
    with torch.no_grad():
        for which in ("prev", "next"):
            Kp, Vp, used = [], [], []
            for l in range(L):
                prev = [j for j, t in enumerate(tids) if t + 1 <= l]
                nxt = [j for j, t in enumerate(tids) if t >= l]
                j = (prev[-1] if prev else nxt[0]) if which == "prev" else (nxt[0] if nxt else prev[-1])
                used.append(tids[j])
                lay = model.model.layers[l]
                x = lay.input_layernorm(He_b[:, j])
                Kp.append(lay.self_attn.k_proj(x))
                Vp.append(lay.self_attn.v_proj(x))
            record(f"verifier proj {which}", torch.cat(Kp, -1), torch.cat(Vp, -1),
                   extra={"target_layer_used": used})
    if ftheta_input not in (None, "drafter_kv"):
        print(f"  (no 'shipped f_theta' row: {a.ftheta} does not read input a)", file=sys.stderr)
    elif a.ftheta:
        fw = {k: v.float() for k, v in load_file(str(Path(a.ftheta) / "f_theta.safetensors")).items()}
        ce = dr.context(He)
        dk, dv = ce @ dr.wk.T, ce @ dr.wv.T
        pk = (dk @ fw["k.encoder.weight"].T + fw["k.encoder.bias"]) @ fw["k.decoder.weight"].T + fw["k.decoder.bias"]
        pv = (dv @ fw["v.encoder.weight"].T + fw["v.encoder.bias"]) @ fw["v.decoder.weight"].T + fw["v.decoder.bias"]
        record("shipped f_theta (input a)", pk, pv)

    # ---- side code ------------------------------------------------------------------------
    # What f_theta cannot predict from the target features, stored at eviction (when the exact K/V
    # are still known) as k numbers per position and path: c = U_k^T (y - pred), restored as
    # pred + U_k c. U_k: top-k principal directions of the fit residual, 1/rms-weighted, on the
    # layers a restored decode takes from f_theta (sliding, not a target layer's successor, not
    # layer 0, which is restored from its token); the other layers get no side code.
    side_ks = a.side_code
    coded = [l for l in nonexact if l != 0]
    side = {"layers": coded, "per_position_values": "k per path (K and V: 2k)", "by_k": {}}

    def side_code(p, pred_fit, pred_eval):
        true_f, true_e = (Kf, Ke) if p == "K" else (Vf, Ve)
        mask = torch.zeros(L, D)
        mask[coded] = 1.0
        w = s[paths[p]] * mask.view(-1)  # 0 on the layers without a side code
        inv_w = torch.where(w > 0, 1 / w, torch.zeros_like(w))
        Rf = (true_f - pred_fit) * w
        U = eig_desc(Rf.T @ Rf)
        del Rf
        Re = (true_e - pred_eval) * w
        key = "k_raw" if p == "K" else "v_raw"
        for k in [0] + side_ks:
            pr = pred_eval + (Re @ U[:, :k]) @ U[:, :k].T * inv_w if k else pred_eval
            e = layer_rel(pr, true_e, L, D)
            side["by_k"].setdefault(str(k), {})[key] = sum(e[i] for i in coded) / len(coded)
        print(f"  side code {p}: " + "  ".join(f"k{k}: {v[key]:.3f}" for k, v in side["by_k"].items()), file=sys.stderr)

    # ---- ridge per input option ----------------------------------------------------------
    alphas = [float(x) for x in a.alphas.split(",")]
    rf = torch.randn(Hf.shape[1], a.rf_dim, generator=torch.Generator().manual_seed(0)) \
        / math.sqrt(Hf.shape[1]) if a.rf_dim else None
    options = [("a", "drafter raw K -> K, raw V -> V (today)"), ("b", "drafter raw K++V (640)"),
               ("c", "drafter context c = hidden_norm(fc(.)) (640)"),
               ("d", f"target features, RMS-normalised ({Hf.shape[1]})")]
    if a.rf_dim:
        options.append(("e", f"d ++ gelu(d R) ({a.rf_dim}) ++ log rms"))
    paths = {"K": slice(0, LD), "V": slice(LD, 2 * LD)}
    Kn = rms_norm_noweight(Kf.view(-1, L, D)).view(-1, LD)  # unit-RMS direction of K per layer
    for opt, desc in options:
        # inputs per path: option a has one input per path, the others one shared input
        ins = {"K": "a_k", "V": "a_v"} if opt == "a" else {"K": opt, "V": opt}
        preds, preds_r, chosen, val_err, dims, dirp = {}, {}, {}, {}, {}, {}
        for fkey in sorted(set(ins.values())):
            pth = [p for p in paths if ins[p] == fkey]
            cols = torch.cat([torch.arange(LD * 2)[paths[p]] for p in pth])
            X = features(fkey, Hf, dr, len(tids), rf)
            m, sd = X.mean(0), X.std(0) + 1e-8  # standardise on all fit rows (a scale, not a fit)
            Z = (X - m) / sd
            Ze = (features(fkey, He, dr, len(tids), rf) - m) / sd
            del X
            dims[fkey] = Z.shape[1]
            Yp = Yf[:, cols] - mu[cols]
            st_t, st_v = Stats(Z[~rowval], Yp[~rowval]), Stats(Z[rowval], Yp[rowval])
            # lambda on the validation split
            Zv, Yv = Z[rowval], Yf[rowval][:, cols]
            errs = {}
            for al, (W, b) in st_t.solve(alphas).items():
                pv = chunked_mm(Zv, W) + b + mu[cols]
                for pi, p in enumerate(pth):
                    e = layer_rel(pv[:, pi * LD:(pi + 1) * LD], Yv[:, pi * LD:(pi + 1) * LD], L, D)
                    errs[(p, al)] = sum(e[i] for i in sliding) / len(sliding)
            del Zv, Yv, pv
            for p in pth:
                chosen[p] = min(alphas, key=lambda al: errs[(p, al)])
                val_err[p] = errs[(p, chosen[p])]
            # refit on all fit data (train + val statistics) with the chosen lambda(s)
            st = st_t + st_v
            del st_t, st_v, Yp
            R = st.fitted_factor()
            for pi, p in enumerate(pth):
                pc = torch.arange(pi * LD, (pi + 1) * LD)
                W, b = st.solve([chosen[p]], cols=pc)[chosen[p]]
                b = b + mu[paths[p]]
                preds[p] = chunked_mm(Ze, W) + b
                # reduced rank: top-r subspace of the (1/rms-weighted) fitted values on the fit data
                sw = s[paths[p]]
                Pr = top_subspace(gram_op(R @ (W * sw)), LD, a.rank, seed=2)
                preds_r[p] = b + ((preds[p] - b) * sw) @ Pr @ Pr.T / sw
                if fkey == "d" and side_ks:
                    side_code(p, chunked_mm(Z, W) + b, preds[p])
                if p == "K":
                    # K only matters through k_norm (scale-free up to eps): also fit the per-layer
                    # unit-RMS direction of K, the best linear fit for cache space
                    W, b = st.with_targets(Z, Kn).solve([chosen[p]])[chosen[p]]
                    dirp["full"] = chunked_mm(Ze, W) + b
                    Pr = top_subspace(gram_op(R @ W), LD, a.rank, seed=3)
                    dirp["r"] = b + (dirp["full"] - b) @ Pr @ Pr.T
            if fkey in a.sweep_inputs.split(","):
                # the same ridge map at every rank of the sweep (fitted-value PCA, as for rank 256)
                U, ce, base = [], [], []
                for pi, p in enumerate(pth):
                    pc = torch.arange(pi * LD, (pi + 1) * LD)
                    W, b = st.solve([chosen[p]], cols=pc)[chosen[p]]
                    G = R @ (W * s[paths[p]])
                    U.append(eig_desc(G.T @ G))
                    ce.append(chunked_mm(Ze, W) * s[paths[p]])
                    base.append(b + mu[paths[p]])
                    del G
                rank_sweep(f"{opt} ridge", U, ce, base)
                del U, ce
            del Z, Ze, st, R
        extra = {"description": desc, "in_dims": dims, "lambda": chosen}
        kdir = lambda P: sum(layer_rel(k_cache(model, P, L, D), Ke_c, L, D)[i] for i in sliding) / len(sliding)
        extra["k_cache_dirfit"] = kdir(dirp["full"])
        record(f"{opt} full rank", preds["K"], preds["V"], val=val_err, extra=extra)
        record(f"{opt} rank {a.rank}", preds_r["K"], preds_r["V"],
               extra={"description": desc, "k_cache_dirfit": kdir(dirp["r"])})

    # ---- report --------------------------------------------------------------------------
    print(f"\nrelative MSE on held-out eval text, mean over {len(sliding)} sliding layers "
          f"(positions >= {a.skip}; V cache = V raw)")
    print("K cache dirfit: the K path fitted to the unit-RMS direction of K instead of raw K, through k_norm")
    print(f"non-exact: the {len(nonexact)} sliding layers whose input is not a target-layer output {nonexact}")
    print(f"{'predictor':34s} {'K raw':>6s} {'V raw':>6s} {'K cache':>7s} {'dirfit':>6s}  non-exact K/V"
          f"  lambda K/V  val(same kinds) K/V")
    for name, r in results.items():
        v = r.get("val_same_kinds")
        vs = f"  {r['lambda']['K']:.0e}/{r['lambda']['V']:.0e}  {v['K']:.3f}/{v['V']:.3f}" if v else ""
        dfit = f"{r['k_cache_dirfit']:6.3f}" if "k_cache_dirfit" in r else " " * 6
        print(f"{name:34s} {r['k_raw']:6.3f} {r['v_raw']:6.3f} {r['k_cache']:7.3f} {dfit}"
              f"  {r['k_raw_nonexact']:.3f}/{r['v_raw_nonexact']:.3f}{vs}")
    print("\nrank sweep (sliding-layer mean K/V raw rel MSE by bottleneck rank):")
    for name in [k for k in sweep if k != "ranks"]:
        print(f"  {name:20s} " + "  ".join(f"r{r}: {v['k_raw']:.3f}/{v['v_raw']:.3f}" for r, v in sweep[name].items()))
    m, f = results["mean"], results[f"pca{a.rank} of target (floor)"]
    kept = {"K": 1 - f["k_raw"] / m["k_raw"], "V": 1 - f["v_raw"] / m["v_raw"]}
    print(f"rank-{a.rank} bottleneck keeps {kept['K']:.1%} (K) / {kept['V']:.1%} (V) of the eval targets' "
          f"variance about the fit mean (sliding-layer mean of raw errors)")
    print("\nper layer, K raw | V raw; * = full-attention layer")
    names = [n for n in results if n.endswith("full rank")] + [f"d rank {a.rank}", f"pca{a.rank} of target (floor)",
                                                              "verifier proj prev"]
    short = lambda n: n.replace(" full rank", "").replace(f"rank {a.rank}", "r").replace(" of target (floor)", "") \
        .replace("verifier proj ", "")
    print("layer " + " ".join(f"{short(n):>13s}" for n in names))
    for l in range(L):
        star = " " if l in sliding else "*"
        print(f"{l:4d}{star} " + " ".join(
            f"{results[n]['per_layer']['k_raw'][l]:6.3f}|{results[n]['per_layer']['v_raw'][l]:6.3f}" for n in names))
    wall = time.time() - t_start
    print(f"\nwall {wall:.0f}s (capture {t_cap:.0f}s)")
    if a.json:
        write_report(a.json, __file__, {
            "threads": a.threads, "model": os.path.relpath(a.model, ROOT), "drafter": os.path.relpath(a.drafter, ROOT),
            "data": {"fit": fit_desc, "eval": eval_desc, "seq_len": a.seq_len, "bos_prepended": True,
                     "fit_rows": Hf.shape[0], "eval_rows": He.shape[0], "positions_from": a.skip,
                     "lambda_split": f"last {a.val_seqs} sequences of every fit source",
                     "note": "fit = Python stdlib source + package READMEs (markdown); eval = license text "
                             "+ Debian changelog: kinds absent from the fit"},
            "metric": "relative MSE sum||pred-true||^2/sum||true||^2 per layer; summary = mean over sliding "
                      "layers; raw = k_proj/v_proj outputs, cache = K after k_norm (V has no norm)",
            "rank": a.rank, "alphas": alphas, "sliding_layers": sliding, "target_layer_ids": tids,
            "nonexact_sliding_layers": nonexact, "side_code": side if side_ks else None, "rank_variance_kept": kept, "rank_sweep": sweep, "results": results, "wall_s": round(wall, 1),
        })


if __name__ == "__main__":
    main()
