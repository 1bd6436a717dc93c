#!/usr/bin/env python3
"""Plots of a `kakeya eval-long --json` report.

  plot_eval_long.py REPORT.json OUT.png

OUT.png      one heat map per decoder config (rows: tasks, columns: contexts, value: mean
             task score, annotated; under it the difference to the oracle in points when the
             report has an oracle config). Cells a partial run (deadline) never reached are grey.
             Skipped when the report has no tasks (--tasks none).
OUT-ppl.png  perplexity of the held-out documents' last tokens against the context: the ratio
             to the reference config's (eval-long --reference) or else the oracle's, paired over
             the same documents, with its 95% interval as error bars, one line per config (the
             plain perplexity when there is neither); configs side by side around each context.
             Skipped when the report has no perplexity.
"""
import json, math, sys, textwrap

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt


def ctx_label(c):
    return f"{c // 1024}k" if c >= 1024 and c % 1024 == 0 else str(c)


def config_title(cfg):
    if cfg["mode"] == "ar":
        return f'{cfg["name"]} (full KV)'
    r = cfg.get("restore") or {}
    bits = [f'sink {r.get("sink")}', f'full attn {r.get("full_attn")}']
    if "layers" in r:
        bits.append(f'layers {r["layers"]}')
    return f'{cfg["name"]} ({", ".join(bits)})'


def cell(cfg, task, ctx):
    c = cfg["tasks"].get(task, {}).get(str(ctx))
    return c["score"] if c else math.nan


def heatmaps(rep, out):
    tasks, contexts, configs = rep["tasks"], rep["contexts"], rep["configs"]
    if not tasks:
        print("no tasks in the report (perplexity only): skipping the heat maps")
        return
    oracle = next((c for c in configs if c["name"] == rep.get("oracle")), None)
    n = len(configs)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(1.1 * len(contexts) * cols + 3.5, (0.4 * len(tasks) + 1.3) * rows + 0.5),
                             squeeze=False, constrained_layout=True)
    cmap = plt.get_cmap("viridis").copy()
    cmap.set_bad("#d0d0d0")
    for ax in axes.flat[n:]:
        ax.axis("off")
    for i_ax, (ax, cfg) in enumerate(zip(axes.flat, configs)):
        grid = [[cell(cfg, t, c) for c in contexts] for t in tasks]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap=cmap, aspect="auto")
        for i, t in enumerate(tasks):
            for j, c in enumerate(contexts):
                v = grid[i][j]
                if math.isnan(v):
                    continue
                text = f"{v:.2f}"
                if oracle is not None and cfg is not oracle and not math.isnan(cell(oracle, t, c)):
                    text += f"\n{100 * (v - cell(oracle, t, c)):+.0f}"
                ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if v < 0.6 else "black")
        ax.set_xticks(range(len(contexts)), [ctx_label(c) for c in contexts])
        ax.set_yticks(range(len(tasks)), tasks if i_ax % cols == 0 else [], fontsize=8)  # rows line up across panels
        ax.set_xlabel("context (tokens)")
        mean = cfg.get("summary", {}).get("mean_score")
        # Panels are narrow at few contexts: the name on its own line, the options wrapped under it.
        title = textwrap.fill(config_title(cfg), width=max(18, 9 * len(contexts)))
        ax.set_title(title + (f"\nmean {mean:.3f}" if mean is not None else ""), fontsize=8)
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="score (second line: Δ vs oracle, points)")
    fig.suptitle(f'kakeya eval-long on {rep.get("device", "?")} ({rep.get("dtype", "?")}), {rep["samples"]} sample(s) '
                 f'per cell{" — PARTIAL (deadline)" if rep.get("partial") else ""}', fontsize=9)
    fig.savefig(out, dpi=120)
    print(f"-> {out}")


def ppl_plot(rep, out):
    contexts, configs = rep["contexts"], rep["configs"]
    if not any(cfg.get("ppl") for cfg in configs):
        print("no perplexity in the report: skipping the perplexity plot")
        return
    # Ratios to the reference when the run named one, else to the oracle (each config's summary
    # holds the paired comparison: vs_reference / vs_oracle).
    base_name, key = (rep["reference"], "vs_reference") if rep.get("reference") else (rep.get("oracle"), "vs_oracle")
    base = next((c for c in configs if c["name"] == base_name), None)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, cfg in enumerate(configs):
        vs = cfg.get("summary", {}).get(key, {})
        dodge = 2 ** (0.04 * (i - (len(configs) - 1) / 2))  # configs side by side on the log axis
        xs, ys, lo, hi = [], [], [], []
        for c in contexts:
            p = cfg["ppl"].get(str(c))
            if not p:
                continue
            if base is not None and cfg is not base:
                r = vs.get("ppl_ratio", {}).get(str(c))
                if r is None:
                    continue
                ci = vs.get("ppl_ratio_ci95", {}).get(str(c)) or [r, r]
                ys.append(r)
                lo.append(r - ci[0])
                hi.append(ci[1] - r)
            else:
                ys.append(1.0 if cfg is base else p["ppl"])
                lo.append(0.0)
                hi.append(0.0)
            xs.append(c * dodge)
        style = "s--" if cfg is base else "o-"
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt=style, capsize=3, label=config_title(cfg))
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [ctx_label(c) for c in contexts])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(f"perplexity / {base_name} perplexity" if base is not None else "perplexity")
    planned = len(rep.get("ppl_docs", []))
    scored = max((p.get("n", 0) for cfg in configs for p in cfg["ppl"].values()), default=0)
    docs = f"{scored} of {planned}" if scored < planned else f"{planned}"
    ax.set_title(f'perplexity of the last {rep.get("ppl_tail")} tokens, {docs} held-out document(s), '
                 f'{rep.get("device", "?")} ({rep.get("dtype", "?")}){" — PARTIAL" if rep.get("partial") else ""}',
                 fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"-> {out}")


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    rep = json.load(open(sys.argv[1]))
    out = sys.argv[2]
    heatmaps(rep, out)
    ppl_plot(rep, (out[:-4] if out.endswith(".png") else out) + "-ppl.png")


if __name__ == "__main__":
    main()
