#!/usr/bin/env python3
"""How many vocabulary rows the lm_head's int8 screen (ops::make_head_screen) would pass to the exact
sums, per position of real text, computed independently of the C++ code with HF transformers on the CPU.

For each position's final hidden state x (the lm_head's input, teacher-forced over the given files):
  a_r = s_r·(x·q_r) with q_r the row's int8 codes (s_r = max|w_r| / 127), bound_r = ||x||·||w_r - s_r·q_r||
  (Cauchy-Schwarz; the C++ bound adds the f32 sums' rounding, a relative 1e-4 here), and the rows kept
  are those whose upper bound, rounded to bf16, reaches the largest lower bound, rounded. Checks that
  the argmax of the exact bf16 logits is always kept, and reports the kept rows' mean, median, p99, max.
Also the same for int4 codes in groups of 32 (the screen would read a quarter of the head), to show
why the screen is int8.

usage: head_screen_census.py --model DIR --files GLOB [GLOB ...] [--max-files N] [--tokens N] [--json OUT]
"""
import argparse, glob, json, os, sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--files", nargs="+", required=True, help="globs of text files (held-out text)")
    ap.add_argument("--max-files", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=300, help="positions a file")
    ap.add_argument("--json")
    a = ap.parse_args()
    if not os.path.isfile(os.path.join(a.model, "config.json")):
        sys.exit(f"head_screen_census: --model {a.model}: no config.json there (an HF model directory expected)")
    files = sorted({f for g in a.files for f in glob.glob(g)})
    if not files:
        sys.exit(f"head_screen_census: no file matches {a.files}")
    files = files[:: max(1, len(files) // a.max_files)][: a.max_files]
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).eval()
    W = model.lm_head.weight.detach().float()
    V, K = W.shape
    feats = []
    h = model.lm_head.register_forward_hook(lambda m, i, o: feats.append(i[0].detach()[0]))
    with torch.no_grad():
        for f in files:
            ids = tok(open(f, errors="ignore").read()[:20000], return_tensors="pt").input_ids[:, : a.tokens]
            model(ids)
    h.remove()
    X = torch.cat(feats).float()
    exact = (X @ W.T).bfloat16().float()
    am = exact.argmax(1)
    xn = X.norm(dim=1, keepdim=True)
    s8 = W.abs().amax(1) / 127
    q8 = torch.round(W / s8[:, None]).clamp(-127, 127) * s8[:, None]
    Wg = W.view(V, K // 32, 32)
    s4 = Wg.abs().amax(2, keepdim=True) / 7
    q4 = (torch.round(Wg / s4).clamp(-7, 7) * s4).view(V, K)
    out = {"model": a.model, "files": files, "positions": X.shape[0], "vocab": V, "K": K, "codes": {}}
    for name, Wq in (("int8 rows", q8), ("int4 groups of 32", q4)):
        a_ = X @ Wq.T
        b = xn * (W - Wq).norm(dim=1)[None, :] * 1.0001
        L = (a_ - b).max(1, keepdim=True).values.bfloat16().float()
        kept = (a_ + b).bfloat16().float() >= L
        n = kept.sum(1).float()
        covered = bool(kept.gather(1, am[:, None]).all())
        out["codes"][name] = {"kept_mean": n.mean().item(), "kept_median": n.median().item(),
                              "kept_p99": n.quantile(0.99).item(), "kept_max": n.max().item(),
                              "argmax_always_kept": covered}
        print(f"{name:>18}: rows kept a position mean {n.mean():.1f}, median {n.median():.0f}, "
              f"p99 {n.quantile(0.99):.0f}, max {n.max():.0f} of {V}; argmax always kept: {covered}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
