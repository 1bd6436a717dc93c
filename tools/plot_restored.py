#!/usr/bin/env python3
"""Plots of the restored-decoder reports.

  plot_restored.py niah  REPORT.json OUT.png   # `kakeya niah --json`: recall ladder vs the
                                               # full-KV oracle, K/V memory vs the baselines
  plot_restored.py sweep REPORT.json OUT.png   # `kakeya sweep-alpha --json`: recall, perplexity
                                               # and restored-K/V error per mixing alpha
"""
import json, sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt


def restore_label(r, alpha=True):  # the restore options a reader needs, not the whole JSON (it overflows the title)
    label = f'sink {r["sink"]}, window {r["window"]}, full attention {r["full_attn"]}'
    return label + (f', a = {r["mix_alpha"]}' if alpha else '')


def niah(rep, out):
    rungs = rep["rungs"]
    ctx = [r["context"] for r in rungs]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    a1.plot(ctx, [100 * r["recall"] for r in rungs], "o-", color="tab:red", label=f'{rep["mode"]} (restored)')
    if all(r["oracle_recall"] >= 0 for r in rungs):
        a1.plot(ctx, [100 * r["oracle_recall"] for r in rungs], "s--", color="tab:blue", label="full-KV oracle (ar)")
    a1.set_xscale("log", base=2)
    a1.set_xticks(ctx, [f"{c // 1024}k" if c >= 1024 else str(c) for c in ctx])
    a1.set_ylim(-5, 105)
    a1.set_xlabel("context (tokens)")
    a1.set_ylabel("NIAH recall (%)")
    g = rep["gates"]
    a1.set_title(f'recall; |Δ| ≤ {g["delta_recall"]["max_pp"]}pp: '
                 f'{"PASS" if g["delta_recall"]["pass"] else ("FAIL" if g["delta_recall"]["checked"] else "not checked")}')
    a1.legend()
    mib = lambda b: b / 2**20
    a2.plot(ctx, [mib(r["memory"]["kv_bytes"]) for r in rungs], "o-", color="tab:red", label="restored decoder (all K/V state)")
    a2.plot(ctx, [mib(r["memory"]["bounded_kv_bytes"]) for r in rungs], "^:", color="tab:orange", label="… of which bounded")
    a2.plot(ctx, [mib(r["memory"]["full_kv_bytes"]) for r in rungs], "s--", color="tab:gray", label="full KV")
    a2.plot(ctx, [mib(r["memory"]["native_kv_bytes"]) for r in rungs], "d--", color="tab:blue", label="native cache (sliding = window)")
    a2.set_xscale("log", base=2)
    a2.set_xticks(ctx, [f"{c // 1024}k" if c >= 1024 else str(c) for c in ctx])
    a2.set_xlabel("context (tokens)")
    a2.set_ylabel("MiB")
    a2.set_title(f'K/V memory ({restore_label(rep["restore"])})', fontsize=9)
    a2.legend(fontsize=8)
    fig.suptitle(f'kakeya niah on {rep["device"]} ({rep["dtype"]})', fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def sweep(rep, out):
    rows = rep["rows"]
    al = [r["alpha"] for r in rows]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(14, 4.2))
    a1.plot(al, [100 * r["recall"] for r in rows], "o-", color="tab:red", label="restored")
    a1.axhline(100 * rep["oracle"]["recall"], ls="--", color="tab:blue", label="full-KV oracle")
    a1.set_ylim(-5, 105)
    a1.set_xlabel("alpha (weight of the true K/V)")
    a1.set_ylabel("NIAH recall (%)")
    a1.legend()
    a2.plot(al, [r["perplexity"] for r in rows], "o-", color="tab:red", label="restored")
    a2.axhline(rep["oracle"]["perplexity"], ls="--", color="tab:blue", label="full KV")
    a2.set_xlabel("alpha")
    a2.set_ylabel(f'perplexity ({rep["ppl_tokens"]} tokens)')
    a2.set_yscale("log")
    a2.legend()
    for typ, mk in (("sliding", "o"), ("full", "s")):
        for key, ls in (("cache_k", "-"), ("cache_v", "--")):
            ys = [r["restore_error_niah"].get(typ, {}).get(key) for r in rows]
            if any(y is not None for y in ys):
                a3.plot([a for a, y in zip(al, ys) if y is not None], [y for y in ys if y is not None], mk + ls,
                        label=f"{typ} {key[-1].upper()}")
    a3.set_xlabel("alpha")
    a3.set_ylabel("relative error of restored K/V (cache space)")
    a3.legend(fontsize=8)
    fig.suptitle(f'kakeya sweep-alpha on {rep["device"]}; {restore_label(rep["restore"], alpha=False)}', fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    kind, src, out = sys.argv[1:4]
    rep = json.load(open(src))
    {"niah": niah, "sweep": sweep}[kind](rep, out)
