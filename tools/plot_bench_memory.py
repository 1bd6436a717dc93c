#!/usr/bin/env python3
"""Plot of a `kakeya bench memory --json` report.

  plot_bench_memory.py REPORT.json OUT.png

OUT.png  per-session K/V bytes against the context, one line per decoder config, the model's
         native cache dashed, each KV budget a dotted horizontal line (where a line crosses a
         budget is the longest context that budget fits); decode tok/s vs AR in the legend
         when the report was timed (--speed).
"""
import json, sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    rep = json.load(open(sys.argv[1]))
    fig, ax = plt.subplots(figsize=(8, 5))
    xs = [p["context"] for p in rep["native_curve"]]
    ax.plot(xs, [p["kv_bytes"] / 1e6 for p in rep["native_curve"]], "k--", lw=1.5, label="native cache")
    for row in rep["configs"]:
        label = row["config"]
        if "decode_ratio_vs_ar" in row:
            label += f' ({row["decode_ratio_vs_ar"]:.3f}x AR decode)'
        ax.plot([p["context"] for p in row["curve"]], [p["kv_bytes"] / 1e6 for p in row["curve"]], marker="o",
                ms=3, label=label)
    for b in rep["budgets_bytes"]:
        ax.axhline(b / 1e6, color="grey", ls=":", lw=1)
        ax.text(xs[0], b / 1e6, f" {b >> 20} MiB budget", va="bottom", fontsize=8, color="grey")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (positions)")
    ax.set_ylabel("K/V per session (MB)")
    ax.set_title(f'K/V per session ({rep.get("dtype", "")}, {rep.get("device", "")})', fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=120)
    print(f"-> {sys.argv[2]}")


if __name__ == "__main__":
    main()
