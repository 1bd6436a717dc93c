#!/usr/bin/env python3
"""Curves of a `kakeya train-ftheta` run: reads SAVE/report.json, writes a PNG with
the training loss and its components (attention-output MSE, K/V direction and
magnitude terms, mean over the trained layers) per step, the held-out loss at
each evaluation, and the final per-layer relative MSE of K and V by layer type.

Usage: plot_ftheta_loss.py REPORT.json OUT.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")  # headless
import matplotlib.pyplot as plt


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    report = json.load(open(sys.argv[1]))
    log, evals = report.get("log", []), report.get("evals", [])
    if not log:
        print(f"{sys.argv[1]}: no training log", file=sys.stderr)
        return 1
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    steps = [p["step"] for p in log]
    ax.plot(steps, [p["loss"] for p in log], color="black", label="loss (train)")
    for key in ["attn", "k_dir", "v_dir", "k_mag", "v_mag"]:
        ax.plot(steps, [p["terms"][key] for p in log], label=key, linewidth=0.8)
    ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o--", color="tab:red", label="loss (held out)")
    ax.set_xlabel("step")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    title = f"{report['options']['loss']}: {report.get('steps_done')} steps, {report.get('train_seconds', 0):.0f}s"
    if "reduction_factor" in report:
        title += f", held-out reduction {report['reduction_factor']:.2f}x"
    ax.set_title(title, fontsize=9)
    if evals:
        layers = evals[-1]["per_layer"]
        xs = [p["layer"] for p in layers]
        colors = ["tab:blue" if p["type"] == "sliding_attention" else "tab:orange" for p in layers]
        ax2.bar([x - 0.2 for x in xs], [p["k_rel_mse"] for p in layers], width=0.4, color=colors, label="K")
        ax2.bar([x + 0.2 for x in xs], [p["v_rel_mse"] for p in layers], width=0.4, color=colors, alpha=0.5, label="V")
        ax2.set_xlabel("verifier layer (blue sliding, orange full; solid K, light V)")
        ax2.set_ylabel("relative MSE (held out, final)")
        ax2.set_title("per-layer relative MSE of predicted raw K/V", fontsize=9)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
