#!/usr/bin/env python3
"""Compares data-parallel f_θ runs of tools/device/train_dist.sh with the one-process run.

Per run (RUN/<name>/report.json, f_theta.safetensors written by `kakeya train-ftheta`): ranks,
steps, training seconds, steps/s and sequences/s, the ratio to the single run, final held-out
loss, and the largest relative difference of any f_θ tensor from the single run's. Writes JSON.
"""
import argparse
import json
import os
import time

from safetensors.torch import load_file


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True, help="directory holding one sub-directory per run")
    ap.add_argument("--names", nargs="+", required=True, help="runs; the first is the baseline")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--note", default="")
    a = ap.parse_args()
    rows, base_rate, base_w = [], None, None
    for name in a.names:
        d = os.path.join(a.run, name)
        rep = json.load(open(os.path.join(d, "report.json")))
        w = load_file(os.path.join(d, "f_theta.safetensors"))
        steps, secs = rep["steps_done"], rep["train_seconds"]
        batch = rep["options"]["batch"]
        rate = steps / secs
        if base_rate is None:
            base_rate, base_w = rate, w
        # Per tensor: max |w - w_single| / max |w_single| (the largest over tensors), and the L2 norm
        # of the difference over the L2 norm of the tensor.
        diff = max(float((w[k].double() - base_w[k].double()).abs().max() / base_w[k].double().abs().max().clamp_min(1e-12))
                   for k in base_w)
        l2 = max(float((w[k].double() - base_w[k].double()).norm() / base_w[k].double().norm().clamp_min(1e-12))
                 for k in base_w)
        rows.append({"name": name, "ranks": rep.get("ranks", 1), "steps": steps, "train_seconds": secs,
                     "steps_per_second": rate, "sequences_per_second": rate * batch,
                     "speed_vs_single": rate / base_rate, "heldout_loss_final": rep.get("heldout_loss_final"),
                     "max_rel_weight_diff_vs_single": diff, "l2_rel_weight_diff_vs_single": l2,
                     "command": rep["command"]})
        print(f"{name:8s} ranks {rows[-1]['ranks']}  {steps} steps in {secs:7.1f} s  {rate:6.3f} step/s "
              f"({rate * batch:6.1f} seq/s, {rate / base_rate:5.2f}x single)  held-out {rows[-1]['heldout_loss_final']:.4f}  "
              f"weight diff vs single: max {diff:.2e}, L2 {l2:.2e}")
    out = {"what": "data-parallel train-ftheta (online, target features, rank 256): one process vs kakeya launch",
           "note": a.note, "commit": a.commit, "gpus": a.gpus, "date": time.strftime("%Y-%m-%d"),
           "command": "tools/device/train_dist.sh", "runs": rows}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
