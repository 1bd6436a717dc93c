#!/usr/bin/env python3
"""Where a persistent-kernel decode step spends its time: a KAKEYA_MEGA_TRACE timeline
(ops::StepProgram::write_trace, one step of `kakeya bench decode --megakernel` or `generate --megakernel`)
summed per body.

  mega_trace.py TRACE.json [OUT.png]

Per instruction i, from the blocks' clocks:
  chain  = last done(i) - last done(i - 1)     its share of the step (the sum is the step's span)
  sync   = first wait end(i) - last done(i - 1) from the last block's count to the first block moving on
  spread = last wait end(i) - first wait end(i) how long the blocks took to all see it
  body   = the longest block's time on its tasks
A kernel run alone between two launches of the persistent kernel (the lm_head's greedy GEMV) lands
in the sync of the instruction after it. OUT.png: chain time per instruction, split into sync and
the rest, coloured by body (bars past 1.6x the 95th percentile clipped, their height written).
"""
import collections, json, re, sys


def short(op):  # a mangled kernel name's identifier: _ZN6kakeya7kernels11gemv_kernelI... -> gemv
    m = re.match(r"_ZN6kakeya7kernels\d+(\w+?)_kernel", op) or re.match(r"_ZN6kakeya7kernels\d+(\w+)", op)
    return m.group(1) if m else op


def rows(trace):
    ins = trace["instructions"]
    out, prev = [], None
    for i, r in enumerate(ins):
        w0, w1 = r["wait_end_ns"]
        d1 = r["done_ns"][1]
        base = prev if prev is not None else w0
        out.append({"i": i, "op": short(r["op"]), "tasks": r["tasks"], "chain": d1 - base, "sync": max(0, w0 - base),
                    "spread": w1 - w0, "body": r["longest_block_ns"]})
        prev = d1
    return out


def summary(rs):
    agg = collections.OrderedDict()
    for r in rs:
        a = agg.setdefault(r["op"], collections.Counter())
        a["n"] += 1
        for k in ("chain", "sync", "spread", "body"):
            a[k] += r[k]
    total = sum(r["chain"] for r in rs)
    lines = [f"{'body':<28}{'n':>5}{'chain us':>10}{'share':>8}{'sync us/ea':>12}{'spread us/ea':>14}{'body us/ea':>12}"]
    for op, a in sorted(agg.items(), key=lambda kv: -kv[1]["chain"]):
        n = a["n"]
        lines.append(f"{op:<28}{n:>5}{a['chain'] / 1e3:>10.1f}{a['chain'] / total:>8.1%}{a['sync'] / n / 1e3:>12.2f}"
                     f"{a['spread'] / n / 1e3:>14.2f}{a['body'] / n / 1e3:>12.2f}")
    lines.append(f"{'step span':<28}{len(rs):>5}{total / 1e3:>10.1f}   (the first instruction's wait end to the last done)")
    return "\n".join(lines)


def plot(rs, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ops = list(dict.fromkeys(r["op"] for r in rs))
    colors = {op: plt.cm.tab20(k % 20) for k, op in enumerate(ops)}
    fig, ax = plt.subplots(figsize=(14, 4.5))
    x = [r["i"] for r in rs]
    ax.bar(x, [r["sync"] / 1e3 for r in rs], color="lightgray", label="sync (last done before -> first wait end)")
    ax.bar(x, [(r["chain"] - r["sync"]) / 1e3 for r in rs], bottom=[r["sync"] / 1e3 for r in rs],
           color=[colors[r["op"]] for r in rs])
    for op in ops:
        ax.bar([0], [0], color=colors[op], label=op)
    # A kernel run alone between two launches (the lm_head, ~90 us) would flatten the rest: clip it
    # and write its height.
    typical = sorted(r["chain"] for r in rs)[int(0.95 * (len(rs) - 1))] / 1e3
    top = 1.6 * typical
    for r in rs:
        if r["chain"] / 1e3 > top:
            ax.text(r["i"], 0.97 * top, f"{r['chain'] / 1e3:.0f} us", ha="center", va="top", fontsize=8, rotation=90)
    ax.set_ylim(0, top)
    ax.set_xlabel("instruction of the step")
    ax.set_ylabel("share of the step (us)")
    ax.set_title(f"persistent-kernel decode step: {sum(r['chain'] for r in rs) / 1e3:.0f} us over {len(rs)} instructions")
    ax.legend(fontsize=7, ncol=4, loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    try:
        trace = json.load(open(sys.argv[1]))
        rs = rows(trace)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        sys.exit(f"{sys.argv[1]}: not a KAKEYA_MEGA_TRACE timeline ({e!r}); expected {{'instructions': [{{'op', 'tasks', "
                 f"'wait_end_ns', 'done_ns', 'longest_block_ns'}}, ...]}}")
    if not rs:
        sys.exit(f"{sys.argv[1]}: no instructions")
    print(summary(rs))
    if len(sys.argv) == 3:
        plot(rs, sys.argv[2])
        print(f"wrote {sys.argv[2]}")


if __name__ == "__main__":
    main()
