#!/usr/bin/env python3
"""The scaling table of data-parallel runs (tools/device/train_dist.sh) against the one-process run.

Per run: ranks, global batch, steps, training seconds, steps/s and sequences/s, the sequences/s ratio
to the first run (equal per-GPU batch on N GPUs: the scaling figure), the final held-out loss and, for
runs at the baseline's global batch, how far the trained weights are from the baseline's (per tensor:
max |w - w0| / max |w0| and ||w - w0|| / ||w0||, the largest over tensors).
  --kind ftheta   RUN/<name>/report.json + checkpoint.safetensors (kakeya train-ftheta --save)
  --kind drafter  RUN/<name>/report.json + train/checkpoint.safetensors (kakeya train-drafter --out)
"""
import argparse
import json
import os
import time

from safetensors.torch import load_file


def load_run(d, kind):
    rep = json.load(open(os.path.join(d, "report.json")))
    if kind == "ftheta":
        ck = os.path.join(d, "checkpoint.safetensors")
        row = {"ranks": rep.get("ranks", 1), "batch": rep["options"]["batch"], "steps": rep["steps_done"],
               "train_seconds": rep["train_seconds"], "heldout_loss_final": rep.get("heldout_loss_final")}
    else:
        ck = os.path.join(d, "train", "checkpoint.safetensors")
        tr = rep["train"]
        ho = rep.get("heldout_teacher_forced", {})
        row = {"ranks": tr.get("ranks", 1), "batch": tr["batch"], "steps": tr["steps"], "train_seconds": tr["seconds"],
               "heldout_loss_final": {k: v["loss"] for k, v in ho.items()}}
    row["command"] = rep.get("train_command", rep.get("command"))
    w = {k: v for k, v in load_file(ck).items() if k.startswith("param/")}
    return row, w


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True, help="directory holding one sub-directory per run")
    ap.add_argument("--names", nargs="+", required=True, help="runs; the first is the one-process baseline")
    ap.add_argument("--kind", choices=["ftheta", "drafter"], required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows, base = [], None
    for name in a.names:
        row, w = load_run(os.path.join(a.run, name), a.kind)
        row["name"] = name
        row["steps_per_second"] = row["steps"] / row["train_seconds"]
        row["sequences_per_second"] = row["steps_per_second"] * row["batch"]
        if base is None:
            base = (row, w)
        row["sequences_per_second_vs_single"] = row["sequences_per_second"] / base[0]["sequences_per_second"]
        if row["batch"] == base[0]["batch"]:
            w0 = base[1]
            row["max_rel_weight_diff_vs_single"] = max(
                float((w[k].double() - w0[k].double()).abs().max() / w0[k].double().abs().max().clamp_min(1e-12))
                for k in w0)
            row["l2_rel_weight_diff_vs_single"] = max(
                float((w[k].double() - w0[k].double()).norm() / w0[k].double().norm().clamp_min(1e-12)) for k in w0)
        rows.append(row)
        diff = (f"weights vs single: max {row['max_rel_weight_diff_vs_single']:.2e}, L2 {row['l2_rel_weight_diff_vs_single']:.2e}"
                if "l2_rel_weight_diff_vs_single" in row else "(other global batch)")
        print(f"{a.kind:7s} {name:12s} ranks {row['ranks']}  batch {row['batch']:3d}  {row['steps']} steps in "
              f"{row['train_seconds']:7.1f} s  {row['steps_per_second']:6.3f} step/s  {row['sequences_per_second']:7.1f} seq/s "
              f"({row['sequences_per_second_vs_single']:5.2f}x single)  {diff}")
    out = {"what": f"data-parallel {a.kind} training: one process vs kakeya launch", "kind": a.kind, "note": a.note,
           "commit": a.commit, "gpus": a.gpus, "date": time.strftime("%Y-%m-%d"),
           "command": "tools/device/train_dist.sh", "runs": rows}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
