#!/usr/bin/env python3
"""Summary of `make demo` (tools/demo.sh): one table from the jobs' JSON reports, printed and
written to OUT/summary.md, plus OUT/memory.png (K/V bytes of the decode sessions).

  demo_summary.py OUT FTHETA_DIR
"""
import json, os, sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt


def load(out, name):
    p = os.path.join(out, name)
    return json.load(open(p)) if os.path.exists(p) else None


def mib(b):
    return f"{b / 1048576:.2f} MiB"


def main(out, ftheta):
    times = dict(l.strip().split("\t") for l in open(os.path.join(out, "times.tsv")) if l.strip())
    rows = []  # (job, result, seconds)

    def row(job, text):
        rows.append((job, text, times.get(job, "")))

    s = load(out, "score.json")
    row("score", f"perplexity {s['perplexity']:.2f} over {s['n_tokens']} tokens, top-1 {100 * s['top1']:.1f}%")
    row("generate", "48 tokens from the plain model (generate.log)")
    c = load(out, "capture.json")
    row("capture", f"{c.get('sequences', '?')} sequences captured (verifier taps + drafter K/V)" if c else "see capture.log")
    r = load(out, "ftheta_toy/report.json")
    row("train_ftheta", f"toy f_θ: held-out loss {r['heldout_loss_initial']:.4g} -> {r['heldout_loss_final']:.4g} "
                        f"({r['reduction_factor']:.2f}x)")
    ce = load(out, "codec_eval.json")
    if ce:
        ours = [x for x in ce["rows"] if x["label"] == "ours"][0]
        row("calibrate", "toy codec bundle from 4096 tokens (calib_toy/)")
        row("codec_eval", f"release recipe through the toy bundle: {ours['bits_per_value']:.2f} bits/value, "
                          f"{ours['ratio']:.2f}x, Δppl {100 * ours['dppl']:+.2f}%, top-1 {100 * ours['top1']:.1f}%")
    mem = {}
    for job in ("decode_ar", "decode_exact", "decode_codec", "decode_compact"):
        d = load(out, job + ".json")
        p = d["prompts"][0]
        m = p["memory"]
        mem[job] = m
        txt = (f"{p['decode_tokens_per_second']:.2f} tok/s, K/V {mib(m['kv_bytes'])} = {m['ratio_vs_full_kv']:.3f}x full KV "
               f"({m['positions']} positions)")
        if "ar" in p:
            txt += f", first {p['ar']['agreeing_prefix']}/{len(p['ar']['generated_ids'])} tokens as ar"
        row(job, txt)
    n = load(out, "niah.json")
    for rg in n["rungs"]:
        row("niah", f"{rg['context']} tokens: recall {100 * rg['recall']:.0f}% vs oracle {100 * rg['oracle_recall']:.0f}%, "
                    f"K/V {rg['memory']['ratio_vs_full_kv']:.3f}x full KV")
    sw = load(out, "sweep.json")
    for x in sw["rows"]:
        err = x.get("restore_error_ppl_text", {}).get("sliding", {})
        row("sweep_alpha", f"a={x['alpha']}: recall {100 * x['recall']:.0f}%, perplexity {x['perplexity']:.2f}, "
                           f"sliding K err {err.get('cache_k', 0):.3f}")
    # K/V bytes per part of the decode sessions, next to full KV.
    fig, ax = plt.subplots(figsize=(10, 4.5))
    names = list(mem)
    bottoms = [0.0] * len(names)
    parts = []
    for m in mem.values():
        for l in m["kv"]:
            if l["name"] not in parts:
                parts.append(l["name"])
    for part in parts:
        vals = [sum(l["bytes"] for l in mem[j]["kv"] if l["name"] == part) / 1048576 for j in names]
        ax.bar(names, vals, bottom=bottoms, label=part)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax.axhline(mem[names[0]]["full_kv_bytes"] / 1048576, color="k", ls="--", label="full KV")
    ax.set_ylabel("K/V bytes (MiB)")
    ax.set_title(f"decode K/V memory at {mem[names[0]]['positions']} positions")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "memory.png"), dpi=110)

    total = int(times.get("total", "0"))
    lines = ["# make demo", "", f"f_θ: `{ftheta}`; total wall time {total // 60}m {total % 60}s on {os.cpu_count()} cores", "",
             "| job | result | seconds |", "|---|---|---|"]
    lines += [f"| {j} | {t} | {sec} |" for j, t, sec in rows]
    lines += ["", "Plots: " + ", ".join(sorted(f for f in os.listdir(out) if f.endswith(".png")) + ["ftheta_toy/loss.png"])]
    text = "\n".join(lines) + "\n"
    open(os.path.join(out, "summary.md"), "w").write(text)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
