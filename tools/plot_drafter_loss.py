#!/usr/bin/env python3
"""Loss curve of a `kakeya train-drafter` run: reads OUT/report.json, writes a PNG
with the weighted cross-entropy and the teacher-forced acceptance length per step
(and the held-out τ per domain in the title when the evaluation has run).

Usage: plot_drafter_loss.py REPORT.json OUT.png
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
    log = report.get("train", {}).get("log", [])
    if not log:
        print(f"{sys.argv[1]}: no training log", file=sys.stderr)
        return 1
    steps = [p["step"] for p in log]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(steps, [p["loss"] for p in log], color="tab:blue", label="weighted CE (train)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss", color="tab:blue")
    ax.set_yscale("log")
    ax2 = ax.twinx()
    ax2.plot(steps, [p["accept_len"] for p in log], color="tab:orange", label="acceptance length (teacher forced)")
    ax2.set_ylabel("acceptance length", color="tab:orange")
    title = f"{report.get('model', '')}: {report['train'].get('steps')} steps, {report['train'].get('seconds', 0):.0f}s"
    ev = report.get("eval")
    if ev:
        title += f"  |  held-out tau: code {ev['code']['tau']:.2f}, prose {ev['prose']['tau']:.2f}"
    ax.set_title(title, fontsize=9)
    fig.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=120)
    print(f"[plot] {sys.argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
