#!/usr/bin/env python3
"""Does f_θ gain from more than the position's own target features? Best linear error with context.

tools/ftheta_capacity.py found the target features (the verifier's hidden states at the drafter's
target layers, RMS-normalised per layer: input d) the best per-position input, and the shipped
rank-1024 f_θ close to d's full-rank linear optimum. What d cannot carry is what a sliding layer
between two tapped layers adds from OTHER positions (its attention). This tool asks, with the same
closed-form ridge regression (the optimum of any linear f_θ on these inputs), how much two cheap
additions recover on held-out text:

  d               the position's target features (today's f_θ input)
  d+emb           + the RMS-normalised token embedding of the position: layer 0's input, so its raw
                  K/V become exact (a 4-byte token id would carry it)
  d+d1+emb        + the previous position's target features (local context: previous-token heads)
  d+d1+d2+emb     + the two previous positions' target features

--mlp-hidden H adds a nonlinear candidate: the ridge prediction from --mlp-input plus a trained one-hidden-layer
MLP (width H, GELU, output layer initialised to zero, so it starts at the ridge optimum) on the non-exact
layers' raw K/V, Adam over --mlp-epochs passes of the fit rows, loss = the sum over those layers of relative
MSE: how much a large nonlinear f_θ of the same input could add to the linear optimum on text it never saw.

Errors: relative MSE per layer of raw K / V (k_proj / v_proj outputs) on positions >= --skip,
averaged over the sliding layers whose input is not a tapped layer's output (the "non-exact" ones:
on the others f_θ is exact already). Fit and evaluation text as tools/ftheta_capacity.py's defaults
(Python stdlib code + package READMEs; the GPL-3 text + apt's changelog); lambda is picked per input
on the evaluation rows among --alphas (the same for every input, so the comparison stays fair; the
figures are optimistic by that choice).

  .venv/bin/python tools/ftheta_context_capacity.py --fit-seqs 64 \\
      --json bench/results/2026-11-30-ftheta-context-capacity-cpu.json
"""
import argparse, json, sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ftheta_capacity as fc  # noqa: E402

INPUTS = [("d", [0], False), ("d+emb", [0], True), ("d+d1+emb", [0, 1], True), ("d+d1+d2+emb", [0, 1, 2], True)]


def fit_mlp(a, Zf, Ze, Yf, Ye, W, b, alpha, nonexact, L, D, t0):
    """The ridge map W, b (at the alpha chosen for this input) + a trained MLP correction on the non-exact layers."""
    cols = torch.cat([torch.arange(p * L * D + l * D, p * L * D + (l + 1) * D) for p in (0, 1) for l in nonexact])
    W, b = W[:, cols], b[cols]
    Tf, Te = Yf[:, cols], Ye[:, cols]
    n_l = 2 * len(nonexact)
    inv = 1.0 / Tf.view(-1, n_l, D).pow(2).sum(-1).mean(0)  # [2·layers]: per-layer relative-MSE weights
    mu, sd = Zf.mean(0), Zf.std(0) + 1e-6
    g = torch.Generator().manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(Zf.shape[1], a.mlp_hidden), torch.nn.GELU(),
                              torch.nn.Linear(a.mlp_hidden, Tf.shape[1]))
    torch.nn.init.zeros_(net[2].weight)
    torch.nn.init.zeros_(net[2].bias)
    opt = torch.optim.Adam(net.parameters(), lr=a.mlp_lr)

    def pred(Z):
        return Z @ W + b + net((Z - mu) / sd)

    def rel(P, T):  # per layer relative MSE, [2·layers]
        return (P - T).view(-1, n_l, D).pow(2).sum(-1).mean(0) * inv

    def evaluate(Z, T):  # per layer Σ‖pred − true‖² / Σ‖true‖² over the set
        with torch.no_grad():
            err = sum((pred(Z[i:i + 4096]) - T[i:i + 4096]).view(-1, n_l, D).pow(2).sum((0, 2))
                      for i in range(0, Z.shape[0], 4096))
        return (err / T.view(-1, n_l, D).pow(2).sum((0, 2))).tolist()

    bs, steps = 1024, 0
    for ep in range(a.mlp_epochs):
        perm = torch.randperm(Zf.shape[0], generator=g)
        for i in range(0, Zf.shape[0], bs):
            idx = perm[i:i + bs]
            loss = rel(pred(Zf[idx]), Tf[idx]).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
        he = evaluate(Ze, Te)
        k, v = sum(he[:len(nonexact)]) / len(nonexact), sum(he[len(nonexact):]) / len(nonexact)
        print(f"  mlp{a.mlp_hidden} epoch {ep + 1}/{a.mlp_epochs}: held-out non-exact K {k:.4f}  V {v:.4f}"
              f"   ({time.time() - t0:.0f}s)", flush=True)
    fe, he = evaluate(Zf, Tf), evaluate(Ze, Te)
    n = len(nonexact)
    return {"alpha": alpha, "hidden": a.mlp_hidden, "epochs": a.mlp_epochs, "steps": steps, "lr": a.mlp_lr,
            "k_raw_nonexact": sum(he[:n]) / n, "v_raw_nonexact": sum(he[n:]) / n,
            "fit_rows_k_raw_nonexact": sum(fe[:n]) / n, "fit_rows_v_raw_nonexact": sum(fe[n:]) / n,
            "per_nonexact_layer": {"layers": nonexact, "k_raw": [round(x, 4) for x in he[:n]],
                                   "v_raw": [round(x, 4) for x in he[n:]]}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(fc.ROOT / "checkpoints/models/gemma3-270m"))
    ap.add_argument("--drafter", default=str(fc.ROOT / "checkpoints/gemma3-270m/drafter"))
    ap.add_argument("--fit-seqs", type=int, default=64, help="fit sequences of --seq-len tokens")
    ap.add_argument("--eval-seqs", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--skip", type=int, default=4, help="positions < skip are left out (sinks)")
    ap.add_argument("--alphas", default="1e-3,1e-1,1,10")
    ap.add_argument("--inputs", default=",".join(n for n, _, _ in INPUTS), help="comma-separated among " +
                    ", ".join(n for n, _, _ in INPUTS))
    ap.add_argument("--mlp-hidden", type=int, default=0, help="width of the MLP candidate (0: none)")
    ap.add_argument("--mlp-input", default="d+emb", help="the MLP candidate's input (one of --inputs' names)")
    ap.add_argument("--mlp-epochs", type=int, default=8)
    ap.add_argument("--mlp-lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    known = {n: (s, e) for n, s, e in INPUTS}
    chosen = [n for n in a.inputs.split(",") if n]
    for n in chosen:
        if n not in known:
            sys.exit(f"ftheta_context_capacity: --inputs: unknown input '{n}' (expected one of {', '.join(known)})")
    if a.mlp_hidden and a.mlp_input not in known:
        sys.exit(f"ftheta_context_capacity: --mlp-input: unknown input '{a.mlp_input}' (expected one of {', '.join(known)})")
    if a.mlp_hidden < 0 or a.mlp_epochs < 1:
        sys.exit("ftheta_context_capacity: --mlp-hidden must be >= 0 and --mlp-epochs >= 1")
    alphas = [float(x) for x in a.alphas.split(",")]
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    t0 = time.time()
    cfg = json.load(open(Path(a.model) / "config.json"))
    L, D = cfg["num_hidden_layers"], cfg["head_dim"]
    sliding = [i for i, t in enumerate(cfg["layer_types"]) if t == "sliding_attention"]
    tok = Tokenizer.from_file(str(Path(a.model) / "tokenizer.json"))
    bos = cfg.get("bos_token_id", 2)
    fit_seqs, fit_desc = fc.make_seqs(tok, fc.DEF_FIT, a.fit_seqs * a.seq_len, a.seq_len, bos)
    eval_seqs, eval_desc = fc.make_seqs(tok, fc.DEF_EVAL, a.eval_seqs * a.seq_len, a.seq_len, bos)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    tids = fc.Drafter(a.drafter).tids
    nonexact = [l for l in sliding if (l - 1) not in tids]
    emb = model.model.embed_tokens

    def capture(seqs):
        H, K, V = fc.capture(model, seqs, tids, 0)
        with torch.no_grad():
            E = torch.cat([emb(torch.tensor([ids]))[0] for _, ids in seqs])
        return H, K, V, E

    Hf, Kf, Vf, Ef = capture(fit_seqs)
    He, Ke, Ve, Ee = capture(eval_seqs)
    print(f"captured {len(fit_seqs)} + {len(eval_seqs)} sequences in {time.time() - t0:.0f}s", file=sys.stderr)
    T = a.seq_len

    def rows(H, E, n, shifts, with_emb):
        d = fc.features("d", H, None, len(tids), None).view(n, T, -1)
        parts = []
        for s in shifts:  # position p reads p - s (zeros before the sequence starts)
            x = torch.zeros_like(d)
            x[:, s:] = d[:, :T - s]
            parts.append(x)
        if with_emb:
            parts.append(fc.rms_norm_noweight(E).view(n, T, -1))
        return torch.cat(parts, -1)[:, a.skip:].reshape(n * (T - a.skip), -1)

    def targets(K, V, n):
        return torch.cat([K, V], -1).view(n, T, -1)[:, a.skip:].reshape(n * (T - a.skip), -1)

    Yf, Ye = targets(Kf, Vf, len(fit_seqs)), targets(Ke, Ve, len(eval_seqs))
    LD = L * D
    results = {}
    for name in chosen:
        shifts, with_emb = known[name]
        Zf, Ze = rows(Hf, Ef, len(fit_seqs), shifts, with_emb), rows(He, Ee, len(eval_seqs), shifts, with_emb)
        best, best_map = None, None
        for alpha, (W, b) in fc.Stats(Zf, Yf).solve(alphas).items():
            P = Ze @ W + b
            kr = fc.layer_rel(P[:, :LD], Ye[:, :LD], L, D)
            vr = fc.layer_rel(P[:, LD:], Ye[:, LD:], L, D)
            r = {"alpha": alpha, "in_dims": Zf.shape[1],
                 "k_raw_nonexact": sum(kr[i] for i in nonexact) / len(nonexact),
                 "v_raw_nonexact": sum(vr[i] for i in nonexact) / len(nonexact),
                 "k_raw": sum(kr[i] for i in sliding) / len(sliding), "v_raw": sum(vr[i] for i in sliding) / len(sliding),
                 "per_nonexact_layer": {"layers": nonexact, "k_raw": [round(kr[i], 4) for i in nonexact],
                                        "v_raw": [round(vr[i], 4) for i in nonexact]}}
            if best is None or r["k_raw_nonexact"] + r["v_raw_nonexact"] < best["k_raw_nonexact"] + best["v_raw_nonexact"]:
                best, best_map = r, (W, b)
        results[name] = best
        print(f"  {name:16s} non-exact sliding layers: K {best['k_raw_nonexact']:.4f}  V {best['v_raw_nonexact']:.4f}"
              f"   (alpha {best['alpha']:g}, {best['in_dims']} inputs, {time.time() - t0:.0f}s)", flush=True)
        if a.mlp_hidden and name == a.mlp_input:
            results[f"{name} + mlp{a.mlp_hidden}"] = fit_mlp(a, Zf, Ze, Yf, Ye, *best_map, best["alpha"], nonexact, L, D, t0)
        del Zf, Ze
    if a.json:
        fc.write_report(a.json, __file__, {
            "threads": a.threads, "data": {"fit": fit_desc, "eval": eval_desc, "seq_len": T, "positions_from": a.skip},
            "metric": "relative MSE sum||pred-true||^2/sum||true||^2 per layer of raw K / V; *_nonexact: mean over "
                      "the sliding layers whose input is not a target-layer output",
            "lambda": "per input, the best of --alphas on the evaluation rows (optimistic, equally for every input)",
            "target_layer_ids": tids, "nonexact_sliding_layers": nonexact, "results": results,
            "wall_s": round(time.time() - t0, 1)})


if __name__ == "__main__":
    main()
