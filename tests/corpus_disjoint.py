#!/usr/bin/env python3
"""Disjointness proof for the f_θ training corpus and the long-context eval texts.

Usage: corpus_disjoint.py SOURCE_DIR     (CTest: test_corpus_disjoint)

Builds a small training corpus with tools/ftheta_corpus.py (twice, default
options, so data/longeval is excluded by default) and checks:
  * data/longeval is what sources.json says (sha256, >= 8 docs of >= 17,000
    tokens from >= 3 kinds of source, haystack size/lines, < 1.5 MB in all;
    token counts re-measured when the real tokenizer is present);
  * no 64-character window of any data/longeval text occurs in the training
    corpus (train + heldout) nor in data/codec/*.txt. Method: every 32-character
    substring of the eval texts (stride 1) goes into a set; the scanned text is
    read at stride 32 (a shared 64-char window always contains a 32-aligned
    32-char chunk); each chunk hit is settled exactly by looking up the 33
    64-char windows that contain it in the set of all eval 64-char windows.
    The scanner itself is checked on planted windows at all 32 alignments;
  * train and heldout share no document and no file, and every file sits in
    the split the path-hash rule gives;
  * the build is deterministic (same sha256 of every output twice);
  * --exclude is honoured: in a synthetic site-packages, files quoting a
    longeval passage are refused by default and by --exclude data/longeval,
    and kept with --no-default-exclude (so it is the exclusion that drops them).
Prints one line per check and "N passed, M failed"; exits 1 on any failure.
"""
import hashlib, json, os, subprocess, sys, tempfile, time
from pathlib import Path

SEP = "<|doc|>"
results = []


def check(name, ok, detail=""):
    results.append(bool(ok))
    print(f"[{'PASS' if ok else 'FAIL'}] {name}" + (f": {detail}" if detail else ""), flush=True)


class Windows:
    """Exact index of an eval text set: all 32-char substrings and all 64-char windows."""

    def __init__(self, texts):
        self.s32, self.s64 = set(), set()
        for t in texts:
            self.s32.update(t[i:i + 32] for i in range(len(t) - 31))
            self.s64.update(t[i:i + 64] for i in range(len(t) - 63))

    def shared(self, t, limit=5):
        """64-char windows of t found in the index (up to limit)."""
        out = []
        for p in range(0, len(t) - 31, 32):
            if t[p:p + 32] in self.s32:
                for s in range(max(0, p - 32), min(p, len(t) - 64) + 1):
                    w = t[s:s + 64]
                    if w in self.s64 and w not in out:
                        out.append(w)
                        if len(out) >= limit:
                            return out
        return out


def run(cmd, **kw):
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        print(r.stdout[-2000:], r.stderr[-4000:], sep="\n", file=sys.stderr)
    return r, time.time() - t0


def docs_of(path):
    text = Path(path).read_text(encoding="utf-8")
    return [d for d in text.split(SEP + "\n")] if text else []


def main():
    src = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]).resolve()
    py = sys.executable
    tool = src / "tools" / "ftheta_corpus.py"
    le = src / "data" / "longeval"
    t_all = time.time()

    # ---- data/longeval as recorded
    meta = json.loads((le / "sources.json").read_text())
    docs = meta["docs"]
    ok_sha = all(hashlib.sha256((le / d["file"]).read_bytes()).hexdigest() == d["sha256"] for d in docs)
    hay = le / "haystack_eval.txt"
    ok_sha &= hashlib.sha256(hay.read_bytes()).hexdigest() == meta["haystack"]["sha256"]
    check("longeval files match sources.json sha256", ok_sha)
    on_disk = sorted(p.name for p in (le / "docs").glob("*.txt"))
    check("longeval: >= 8 docs, all listed", len(on_disk) >= 8 and on_disk == sorted(Path(d["file"]).name for d in docs),
          f"{len(on_disk)} docs")
    kinds = {d["kind"] for d in docs}
    check("longeval: >= 3 kinds of source", len(kinds) >= 3, ", ".join(sorted(kinds)))
    tok_path = src / "checkpoints" / "models" / "gemma3-270m" / "tokenizer.json"
    counts = {d["file"]: d["tokens"] for d in docs}
    how = "sources.json"
    try:
        from tokenizers import Tokenizer
        if tok_path.is_file():
            tok = Tokenizer.from_file(str(tok_path))
            counts = {d["file"]: len(tok.encode((le / d["file"]).read_text(), add_special_tokens=False).ids) for d in docs}
            how = "re-measured with " + str(tok_path.relative_to(src))
    except ImportError:
        pass
    check("longeval: every doc >= 17,000 tokens", min(counts.values()) >= 17000 and
          all(counts[f] == d["tokens"] for d in docs for f in [d["file"]]),
          f"min {min(counts.values())} ({how})")
    hlines = [l for l in hay.read_text().split("\n") if l.strip()]
    hsize = hay.stat().st_size
    check("longeval: haystack 300-600 KB of non-empty prose lines", 300_000 <= hsize <= 600_000 and len(hlines) >= 16
          and not any(c in l for l in hlines for c in "<>{}\\`"), f"{hsize} B, {len(hlines)} lines")
    total = sum(p.stat().st_size for p in le.rglob("*") if p.is_file())
    check("longeval: < 1.5 MB in all", total < 1_500_000, f"{total} B")
    eval_texts = {str(p.relative_to(src)): p.read_text(encoding="utf-8") for p in sorted(le.rglob("*.txt"))}

    # ---- the scanner finds planted windows at every alignment
    t0 = time.time()
    idx = Windows(eval_texts.values())
    t_index = time.time() - t0
    sample = eval_texts[sorted(eval_texts)[0]]
    planted_ok = True
    for k in range(32):
        w = sample[5000 + 977 * k: 5000 + 977 * k + 64]
        host = "\x01" * (100 + k) + w + "\x02" * 100  # filler that no eval text contains
        planted_ok &= w in idx.shared(host)
        planted_ok &= not idx.shared(host.replace(w, w[:63] + "\x00"))  # 63 chars of it are not enough
    check("scanner detects planted 64-char windows at all 32 alignments (and not 63)", planted_ok,
          f"index {len(idx.s32)} + {len(idx.s64)} windows in {t_index:.1f}s")

    # ---- data/codec has no longeval window
    for name in ("calib.txt", "eval.txt"):
        p = src / "data" / "codec" / name
        sh = idx.shared(p.read_text(encoding="utf-8"))
        check(f"no longeval 64-char window in data/codec/{name}", not sh, repr(sh[:2]) if sh else "")

    with tempfile.TemporaryDirectory(prefix="corpus_disjoint.") as tmp:
        tmp = Path(tmp)
        # ---- build twice with the defaults (exclusion of data/longeval by default)
        outs, secs = [], []
        for k in ("a", "b"):
            r, dt = run([py, str(tool), "--out", str(tmp / k), "--max-mb", "6"], cwd=src)
            outs.append(tmp / k)
            secs.append(dt)
            if r.returncode != 0:
                check(f"ftheta_corpus build {k}", False, f"exit {r.returncode}")
                return finish(t_all)
        check("ftheta_corpus builds (max 6 MB)", True, f"{secs[0]:.1f}s, {secs[1]:.1f}s")
        man = json.loads((outs[0] / "manifest.json").read_text())
        check("manifest: default exclude is data/longeval", man["exclude"]["dirs"] == ["data/longeval"] and
              man["exclude"]["eval_files"] == len(eval_texts), str(man["exclude"]["dirs"]))
        cats = man["categories"]
        check("corpus: every category present in train", all(cats[c]["train"]["bytes"] > 0 for c in cats),
              ", ".join(f"{c} {cats[c]['train']['bytes'] + cats[c]['heldout']['bytes']} B" for c in cats))
        check("corpus: heldout non-empty", man["totals"]["heldout"]["docs"] > 0,
              f"train {man['totals']['train']['docs']} docs, heldout {man['totals']['heldout']['docs']} docs")

        # ---- disjointness of the training corpus from longeval
        t0 = time.time()
        for sp in ("train", "heldout"):
            sh = idx.shared((outs[0] / f"{sp}.txt").read_text(encoding="utf-8"))
            check(f"no longeval 64-char window in corpus {sp}.txt", not sh, repr(sh[:2]) if sh else "")
        t_scan = time.time() - t0

        # ---- split: no shared document / file, rule respected, doc size
        tr, ho = docs_of(outs[0] / "train.txt"), docs_of(outs[0] / "heldout.txt")
        check("train and heldout share no document", not (set(tr) & set(ho)), f"{len(tr)} + {len(ho)} docs")
        check("every document <= 64 KB", all(len(d.encode()) <= 64 * 1024 for d in tr + ho))
        rows = [l.split("\t") for l in (outs[0] / "files.tsv").read_text().splitlines()[1:]]
        by_split = {}
        for r_ in rows:
            by_split.setdefault(r_[0], set()).add((r_[2], r_[3]))
        both = by_split.get("train", set()) & by_split.get("heldout", set())
        check("train and heldout share no file", not both, f"{len(rows)} file entries")
        frac = man["options"]["heldout"]

        def rule(label, rel):
            if label == "repo":
                return "train"
            h = int(hashlib.sha256(f"{label}/{rel}".encode()).hexdigest()[:8], 16) % 10000
            return "heldout" if h < frac * 10000 else "train"
        check("every file is in the split of its path hash", all(rule(r_[2], r_[3]) == r_[0] for r_ in rows))

        # ---- determinism
        same = all((outs[0] / f).read_bytes() == (outs[1] / f).read_bytes()
                   for f in ("train.txt", "heldout.txt", "files.tsv"))
        mb = json.loads((outs[1] / "manifest.json").read_text())
        same &= man["outputs"] == mb["outputs"]
        check("deterministic: same outputs and sha256 twice", same, man["outputs"]["train.txt"]["sha256"][:16])

        # ---- --exclude honoured on a synthetic site-packages
        site, std = tmp / "site", tmp / "stdlib"
        (site / "pkg").mkdir(parents=True)
        std.mkdir()
        d3 = eval_texts["data/longeval/docs/03.txt"]
        quote = d3[20000:20100]  # several lines of perldiag
        line = next(l for l in eval_texts["data/longeval/haystack_eval.txt"].split("\n") if len(l) >= 120)[:120]
        filler = "".join(f"line {i} of a harmless file about nothing in particular\n" for i in range(40))
        (site / "pkg" / "clean.md").write_text("# Clean\n\n" + filler)
        (site / "pkg" / "leak.md").write_text("# Notes\n\n" + filler + quote + "\n" + filler)
        (site / "pkg" / "leak.py").write_text('X = 1\nDOC = """' + quote + '"""\n' + filler.replace("line", "# line"))
        (site / "pkg" / "leak.json").write_text(json.dumps({"lines": filler.split("\n"), "q": line}, indent=1,
                                                          ensure_ascii=False) + "\n")
        base = [py, str(tool), "--stdlib", str(std), "--site", str(site), "--no-repo-text", "--no-docstrings",
                "--max-mb", "1", "--heldout", "0"]
        taken = {}
        for mode, extra in (("default", []), ("explicit", ["--no-default-exclude", "--exclude", str(le)]),
                            ("none", ["--no-default-exclude"])):
            o = tmp / f"ex_{mode}"
            r, _ = run(base + ["--out", str(o)] + extra, cwd=src)
            if r.returncode != 0:
                check(f"--exclude run ({mode})", False, f"exit {r.returncode}")
                return finish(t_all)
            taken[mode] = {l.split("\t")[3] for l in (o / "files.tsv").read_text().splitlines()[1:]}
            taken[mode + "_refused"] = json.loads((o / "manifest.json").read_text())["exclude"]["refused"]
        leaks = {"pkg/leak.md", "pkg/leak.py", "pkg/leak.json"}
        check("--exclude (default): quoting files refused, clean file kept",
              not (taken["default"] & leaks) and "pkg/clean.md" in taken["default"]
              and {f"site/{x}" for x in leaks} <= set(taken["default_refused"]), str(sorted(taken["default_refused"])))
        check("--exclude data/longeval (explicit): quoting files refused",
              not (taken["explicit"] & leaks) and "pkg/clean.md" in taken["explicit"])
        check("--no-default-exclude: the same files are kept (the exclusion is what drops them)",
              leaks <= taken["none"] and not taken["none_refused"])
    print(f"timings: longeval index {t_index:.1f}s, corpus builds {secs[0]:.1f}s + {secs[1]:.1f}s, "
          f"corpus scan {t_scan:.1f}s")
    return finish(t_all)


def finish(t_all):
    n_ok = sum(results)
    n_bad = len(results) - n_ok
    print(f"{n_ok} passed, {n_bad} failed ({time.time() - t_all:.1f}s)")
    return 1 if n_bad else 0


if __name__ == "__main__":
    sys.exit(main())
