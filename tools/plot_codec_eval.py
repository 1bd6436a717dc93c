#!/usr/bin/env python3
"""Pareto plot of a `kakeya codec-eval --json` report: Δppl (%) against the
compression ratio vs bf16, one point per codec, the Pareto frontier (higher
ratio, lower Δppl) joined, and the target region of issue #5 (ratio >= 4.5x,
Δppl <= +3%) shaded. Top-1 agreement is printed next to each label.

Usage: plot_codec_eval.py REPORT.json OUT.png
"""
import json, sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(src, out):
    rep = json.load(open(src))
    rows = [r for r in rep["rows"] if r["ratio"] > 1.0001]  # the uncoded row sits at (1, 0)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    xs = [r["ratio"] for r in rows]
    ys = [100 * r["dppl"] for r in rows]
    ax.fill_between([4.5, max(xs + [5]) * 1.08], -1, 3, color="tab:green", alpha=0.08, label="target: ≥4.5x, Δppl ≤ +3%")
    for r, x, y in zip(rows, xs, ys):
        ours = r["label"].startswith(("ours", "kakeya"))
        ax.scatter([x], [max(y, 1e-3)], s=60 if ours else 36, marker="*" if ours else "o",
                   color="tab:red" if ours else "tab:blue", zorder=3)
        ax.annotate(f'{r["label"]}  (top-1 {100 * r["top1"]:.1f}%)', (x, max(y, 1e-3)), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    # Pareto frontier: sorted by ratio descending, keep points that lower Δppl.
    front, best = [], float("inf")
    for x, y in sorted(zip(xs, ys), key=lambda p: -p[0]):
        if y < best:
            front.append((x, y))
            best = y
    front.sort()
    ax.plot([p[0] for p in front], [max(p[1], 1e-3) for p in front], "--", color="gray", lw=1, label="Pareto frontier")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel("compression ratio vs bf16 (all side information counted)")
    ax.set_ylabel("Δppl vs uncoded cache (%)")
    ax.set_title(f'Scenario A: {rep.get("model", "")}, ctx {rep.get("context")}, n-eval {rep.get("n_eval")}, '
                 f'{rep.get("passages")} passage(s), {rep.get("device", "")} {rep.get("dtype", "")}', fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=130)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
