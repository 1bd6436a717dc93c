#!/usr/bin/env python3
"""f_θ training corpus, built from the Python installation this script runs under.

The GPU machine has no network and each call carries only a few MiB, so the
corpus is built there, deterministically, from files it already has:

  code        .py files of the stdlib (sysconfig 'stdlib', without its
              site-packages/dist-packages) and of every site-packages root
              (sysconfig purelib/platlib, site.getsitepackages(), user site)
  prose       .md/.rst/.txt files of site-packages, METADATA/PKG-INFO and
              LICENSE*/COPYING*/NOTICE*/AUTHORS* of *.dist-info/*.egg-info,
              data/codec/calib.txt + eval.txt of this repo (always train);
              when these fall short of the prose share, docstrings of the
              .py files (ast; module, class, function docstrings of at least
              200 characters, one document per file) top it up
  structured  .json .yaml .yml .toml .cfg .ini .csv of site-packages

Filters: size within [--min-bytes, --max-file-kb], valid UTF-8, at least 97%
printable characters, no line over 4000 characters and at most 300 bytes per
line on average (minified/generated data), no line equal to the separator.
Files are deduplicated by the SHA-256 of their text (newlines normalised,
trailing blanks removed); the first in the seeded order wins.

Split: a file (and every document cut from it) goes to 'heldout' when
sha256("<root label>/<path relative to its root>") mod 10000 < heldout_frac *
10000, else to 'train' (root labels: stdlib, site, repo), so the split does not
depend on where Python is installed nor on what else is there.

Budget: --max-mb megabytes (10^6 bytes) of text in all, shared by category
(--mix, default code 45% / prose 35% / structured 20%) and, inside a category,
by split in proportion heldout_frac. Categories are filled structured, prose,
code; what one cannot fill is handed to the later ones in proportion to their
shares. Each category takes files in a seeded shuffle (sorted by
sha256("<seed>\\0<label>/<rel>")) until its budgets are met; the manifest records
the actual mix. No directory gives more than --dir-cap (5%) of a category's
budget (one family of generated files, e.g. numeric test vectors, cannot fill it).

Documents longer than 64 KB are cut at line boundaries into pieces of at most
64 KB. Outputs: OUT/train.txt, OUT/heldout.txt (documents, each ending in a
newline, separated by a line holding only <|doc|>; files in a seeded order,
pieces of one file kept in order), OUT/files.tsv (every file taken) and
OUT/manifest.json (Python version, roots, options, files/documents/bytes/tokens
per category and split, the reasons files were skipped, the sha256 of each
output). Tokens are counted with the real tokenizer given --tokenizer, else
estimated as bytes/4.

Disjointness from evaluation data: --exclude DIR (repeatable) refuses every
document that shares a 64-character window with any *.txt under DIR. Run from
the repo, data/longeval is excluded by default (--no-default-exclude turns
that off). Method: every 32-character substring of the eval texts (stride 1)
is hashed into a set; a document is scanned at stride 32 (any shared 64-char
window contains a 32-aligned 32-char chunk), and each hit is confirmed by
looking up the 33 64-character windows around it in a second set (every
64-char window of the eval texts), then by an exact substring test.

Usage: python3 tools/ftheta_corpus.py --out /tmp/corpus [--tokenizer /tmp/models/gemma3-270m/tokenizer.json]
       [--max-mb 24] [--heldout 0.05] [--seed 0] [--mix code=0.45,prose=0.35,structured=0.20]
"""
import argparse, ast, hashlib, json, os, platform, random, site, sys, sysconfig, time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEP = "<|doc|>"
DOC_MAX = 64 * 1024
CATS = ("code", "prose", "structured")
FILL_ORDER = ("structured", "prose", "code")
CODE_EXT = {".py"}
PROSE_EXT = {".md", ".rst", ".txt"}
STRUCT_EXT = {".json", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".csv"}
META_PREFIX = ("METADATA", "PKG-INFO", "LICENSE", "LICENCE", "COPYING", "NOTICE", "AUTHORS")
SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", ".git"}


# ---------------------------------------------------------------- enumeration
def site_roots():
    cands = [sysconfig.get_paths().get(k) for k in ("purelib", "platlib")]
    try:
        cands += site.getsitepackages()
    except AttributeError:
        pass
    try:
        cands.append(site.getusersitepackages())
    except AttributeError:
        pass
    out = []
    for c in cands:
        if c and os.path.isdir(c):
            r = os.path.realpath(c)
            if r not in out:
                out.append(r)
    # A root inside another one would list its files twice.
    return [r for r in out if not any(r != o and r.startswith(o + os.sep) for o in out)]


def walk(root, skip_nested):
    """Sorted (abs, rel) of regular files under root; nested site roots skipped when skip_nested."""
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not (skip_nested and x in SKIP_DIRS) and x != "__pycache__")
        for f in sorted(files):
            p = os.path.join(d, f)
            if os.path.isfile(p) and not os.path.islink(p):
                yield p, os.path.relpath(p, root).replace(os.sep, "/")


def category(rel, label):
    name = rel.rsplit("/", 1)[-1]
    ext = os.path.splitext(name)[1].lower()
    if ext in CODE_EXT:
        return "code"
    if label == "stdlib":
        return None
    if ext in PROSE_EXT:
        return "prose"
    if ext in STRUCT_EXT:
        return "structured"
    parent = rel.split("/")
    in_meta = any(p.endswith((".dist-info", ".egg-info")) for p in parent[:-1])
    if in_meta and name.upper().startswith(META_PREFIX):
        return "prose"
    return None


# ---------------------------------------------------------------- filters
def load_text(path, min_bytes, max_bytes):
    """(text, None) or (None, reason)."""
    try:
        size = os.path.getsize(path)
    except OSError:
        return None, "unreadable"
    if size < min_bytes:
        return None, "too_small"
    if size > max_bytes:
        return None, "too_big"
    try:
        raw = Path(path).read_bytes()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None, "not_utf8"
    return clean(text)


def clean(text):
    text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    lines = [l.rstrip() for l in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    if not lines:
        return None, "empty"
    text = "\n".join(lines) + "\n"
    if any(l == SEP for l in lines):
        return None, "has_separator"
    flat = text.replace("\n", "").replace("\t", "")
    if not flat.isprintable() and sum(1 for c in flat if not c.isprintable()) > 0.03 * len(text):
        return None, "binaryish"
    if max(len(l) for l in lines) > 4000 or len(text.encode()) / len(lines) > 300:
        return None, "minified"
    return text, None


def docstrings(text, min_len=200):
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            d = ast.get_docstring(node, clean=True)
            if d and len(d) >= min_len:
                out.append(d.strip())
    return "\n\n".join(out) + "\n" if out else None


def split_doc(text):
    """Pieces of at most DOC_MAX bytes, cut at line boundaries (a line never exceeds 4000 chars)."""
    if len(text.encode()) <= DOC_MAX:
        return [text]
    out, cur, n = [], [], 0
    for line in text.splitlines(keepends=True):
        b = len(line.encode())
        if cur and n + b > DOC_MAX:
            out.append("".join(cur))
            cur, n = [], 0
        cur.append(line)
        n += b
    if cur:
        out.append("".join(cur))
    return out


# ---------------------------------------------------------------- exclusion
class Excluder:
    """Refuses texts sharing a 64-character window with the eval texts."""

    def __init__(self, dirs):
        self.texts, self.files = [], []
        for d in dirs:
            for p in sorted(Path(d).rglob("*.txt")):
                self.files.append(str(p))
                self.texts.append(p.read_text(encoding="utf-8"))
        self.s32, self.s64 = set(), set()
        for t in self.texts:
            self.s32.update(hash(t[i:i + 32]) for i in range(len(t) - 31))
            self.s64.update(hash(t[i:i + 64]) for i in range(len(t) - 63))
        self.hits = 0

    def overlaps(self, t):
        if not self.texts:
            return False
        s32, s64 = self.s32, self.s64
        for p in range(0, len(t) - 31, 32):
            if hash(t[p:p + 32]) in s32:
                for s in range(max(0, p - 32), min(p, len(t) - 64) + 1):
                    w = t[s:s + 64]
                    if hash(w) in s64 and any(w in e for e in self.texts):
                        self.hits += 1
                        return True
        return False


# ---------------------------------------------------------------- progress
class Progress:
    def __init__(self, total):
        self.total, self.done, self.t0, self.last = total, 0, time.time(), 0.0
        self.tty = sys.stderr.isatty()

    def update(self, n, label, final=False):
        self.done += n
        now = time.time()
        if not final and now - self.last < (0.5 if self.tty else 5.0):
            return
        self.last = now
        el = max(now - self.t0, 1e-6)
        rate = self.done / el
        eta = max(self.total - self.done, 0) / rate if rate > 0 else float("inf")
        msg = (f"[ftheta_corpus] {label:10s} {self.done / 1e6:7.2f}/{self.total / 1e6:.2f} MB  "
               f"{rate / 1e6:5.2f} MB/s  elapsed {el:5.1f}s  ETA {eta:5.1f}s")
        print(("\r" + msg) if self.tty else msg, end="" if self.tty and not final else "\n",
              file=sys.stderr, flush=True)


# ---------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-mb", type=float, default=24.0, help="total text, MB = 10^6 bytes (default 24)")
    ap.add_argument("--heldout", type=float, default=0.05, help="heldout fraction (default 0.05)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mix", default="code=0.45,prose=0.35,structured=0.20")
    ap.add_argument("--tokenizer", help="tokenizer.json for exact token counts (else bytes/4)")
    ap.add_argument("--exclude", action="append", default=[], help="refuse text overlapping *.txt under DIR")
    ap.add_argument("--no-default-exclude", action="store_true", help="do not exclude data/longeval of the repo")
    ap.add_argument("--no-repo-text", action="store_true", help="leave out data/codec/{calib,eval}.txt")
    ap.add_argument("--no-docstrings", action="store_true", help="no docstring top-up of prose")
    ap.add_argument("--stdlib", help="stdlib root (default sysconfig 'stdlib')")
    ap.add_argument("--site", action="append", help="site-packages root (repeatable; default: this Python's)")
    ap.add_argument("--dir-cap", type=float, default=0.05,
                    help="at most this fraction of a category's budget from one directory (default 0.05)")
    ap.add_argument("--min-bytes", type=int, default=128)
    ap.add_argument("--max-file-kb", type=int, default=512)
    a = ap.parse_args()
    t_start = time.time()

    mix = {k: float(v) for k, v in (x.split("=") for x in a.mix.split(","))}
    assert set(mix) == set(CATS) and abs(sum(mix.values()) - 1) < 1e-6, "--mix needs code, prose, structured summing to 1"
    excl_dirs = list(a.exclude)
    default_ex = REPO / "data" / "longeval"
    if not a.no_default_exclude and default_ex.is_dir() and str(default_ex) not in map(lambda d: str(Path(d).resolve()), excl_dirs):
        excl_dirs.append(str(default_ex))
    for d in excl_dirs:
        if not Path(d).is_dir():
            sys.exit(f"ftheta_corpus: --exclude {d}: no such directory")
    t0 = time.time()
    ex = Excluder(excl_dirs)
    t_index = time.time() - t0

    stdlib = os.path.realpath(a.stdlib or sysconfig.get_paths()["stdlib"])
    sites = [os.path.realpath(s) for s in a.site] if a.site else site_roots()
    roots = [("stdlib", stdlib, True)] + [("site", s, False) for s in sites]

    # Candidates per category: (order key, label, rel, abs path, kind).
    t0 = time.time()
    cands = {c: [] for c in CATS}
    seen_real = set()
    for label, root, is_stdlib in roots:
        if not os.path.isdir(root):
            continue
        for path, rel in walk(root, is_stdlib):
            c = category(rel, label)
            if c is None:
                continue
            rp = os.path.realpath(path)
            if rp in seen_real:
                continue
            seen_real.add(rp)
            key = hashlib.sha256(f"{a.seed}\0{label}/{rel}".encode()).hexdigest()
            cands[c].append((key, label, rel, path, "file"))
    for c in CATS:
        cands[c].sort()
    if not a.no_docstrings:  # docstrings top up prose, after every prose file
        cands["prose"] += [(k, l, r, p, "docstrings") for (k, l, r, p, _) in cands["code"]]
    t_enum = time.time() - t0

    def split_of(label, rel):
        if label == "repo":
            return "train"
        h = int(hashlib.sha256(f"{label}/{rel}".encode()).hexdigest()[:8], 16) % 10000
        return "heldout" if h < a.heldout * 10000 else "train"

    total = int(a.max_mb * 1e6)
    prog = Progress(total)
    chosen = {s: [] for s in ("train", "heldout")}  # (order key, [docs], category, label, rel)
    stats = {c: {s: {"files": 0, "docs": 0, "bytes": 0} for s in ("train", "heldout")} for c in CATS}
    skipped = {c: {} for c in CATS}
    overlap_files = []
    seen_hash = set()
    budget_cat = {c: mix[c] * total for c in CATS}
    filled = {}
    listing = []

    dir_bytes = {}

    def dir_of(label, rel):
        return (label, rel.rsplit("/", 1)[0] if "/" in rel else "")

    def take(c, key, label, rel, kind, text, sp, budgets):
        docs = split_doc(text)
        kept = []
        dk = (c,) + dir_of(label, rel)
        for d in docs:
            if stats[c][sp]["bytes"] >= budgets[sp] or dir_bytes.get(dk, 0) >= dir_cap:
                break
            b = len(d.encode())
            kept.append(d)
            dir_bytes[dk] = dir_bytes.get(dk, 0) + b
            stats[c][sp]["bytes"] += b
            stats[c][sp]["docs"] += 1
            prog.update(b, c)
        if kept:
            stats[c][sp]["files"] += 1
            chosen[sp].append((key, kept, c, label, rel))
            listing.append((sp, c, label, rel, kind, sum(len(d.encode()) for d in kept),
                            hashlib.sha256("".join(kept).encode()).hexdigest()))

    def skip(c, why):
        skipped[c][why] = skipped[c].get(why, 0) + 1

    for i, c in enumerate(FILL_ORDER):
        budgets = {"heldout": budget_cat[c] * a.heldout, "train": budget_cat[c] * (1 - a.heldout)}
        dir_cap = max(a.dir_cap * budget_cat[c], DOC_MAX)  # repo text is exempt (below)
        if c == "prose" and not a.no_repo_text:
            for name in ("calib.txt", "eval.txt"):
                p = REPO / "data" / "codec" / name
                if not p.is_file():
                    continue
                text, why = clean(p.read_text(encoding="utf-8"))
                if text is None:
                    skip(c, why)
                    continue
                h = hashlib.sha256(text.encode()).hexdigest()
                if h in seen_hash:
                    skip(c, "duplicate")
                    continue
                if ex.overlaps(text):
                    skip(c, "overlaps_eval")
                    overlap_files.append(f"repo/data/codec/{name}")
                    continue
                seen_hash.add(h)
                cap, dir_cap = dir_cap, float("inf")
                take(c, "", "repo", f"data/codec/{name}", "file", text, "train", budgets)
                dir_cap = cap
        for key, label, rel, path, kind in cands[c]:
            if all(stats[c][s]["bytes"] >= budgets[s] for s in budgets):
                break
            sp = split_of(label, rel)
            if stats[c][sp]["bytes"] >= budgets[sp]:
                continue
            if dir_bytes.get((c,) + dir_of(label, rel), 0) >= dir_cap:
                skip(c, "dir_cap")
                continue
            if kind == "docstrings":
                text, why = load_text(path, a.min_bytes, a.max_file_kb * 1024)
                if text is not None:
                    d = docstrings(text)
                    text, why = clean(d) if d else (None, "no_docstrings")
                why = why and "docstrings_" + why
            else:
                text, why = load_text(path, a.min_bytes, a.max_file_kb * 1024)
            if text is None:
                skip(c, why)
                continue
            h = hashlib.sha256(text.encode()).hexdigest()
            if h in seen_hash:
                skip(c, "duplicate")
                continue
            seen_hash.add(h)
            if ex.overlaps(text):
                skip(c, "overlaps_eval")
                overlap_files.append(f"{label}/{rel}" + (" (docstrings)" if kind == "docstrings" else ""))
                continue
            take(c, key, label, rel, kind, text, sp, budgets)
        got = sum(stats[c][s]["bytes"] for s in budgets)
        filled[c] = got
        short = budget_cat[c] - got
        rest = FILL_ORDER[i + 1:]
        if short > 0 and rest:  # hand what this category could not fill to the later ones
            w = sum(mix[r] for r in rest)
            for r in rest:
                budget_cat[r] += short * mix[r] / w
    prog.update(0, "done", final=True)

    # Write: files in a seeded order, the pieces of one file in order.
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    outputs = {}
    token_counts = {c: {s: None for s in chosen} for c in CATS}
    tok = None
    if a.tokenizer:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(a.tokenizer)
    t0 = time.time()
    tprog = Progress(sum(stats[c][s]["bytes"] for c in CATS for s in chosen))
    for sp, items in chosen.items():
        items.sort(key=lambda x: (x[2], x[0], x[3], x[4]))
        rng.shuffle(items)
        docs = [d for it in items for d in it[1]]
        body = (SEP + "\n").join(docs)
        data = body.encode()
        (out / f"{sp}.txt").write_bytes(data)
        outputs[f"{sp}.txt"] = {"bytes": len(data), "docs": len(docs), "sha256": hashlib.sha256(data).hexdigest()}
        for c in CATS:
            cd = [d for it in items if it[2] == c for d in it[1]]
            if tok is None:
                token_counts[c][sp] = sum(len(d.encode()) for d in cd) // 4
            else:
                n = 0
                for j in range(0, len(cd), 256):
                    n += sum(len(e.ids) for e in tok.encode_batch(cd[j:j + 256], add_special_tokens=False))
                    tprog.update(sum(len(d.encode()) for d in cd[j:j + 256]), "tokenize")
                token_counts[c][sp] = n
    if tok is not None:
        tprog.update(0, "tokenized", final=True)
    t_tok = time.time() - t0
    listing.sort()
    with open(out / "files.tsv", "w") as f:
        f.write("split\tcategory\troot\tpath\tkind\tbytes\tsha256\n")
        for row in listing:
            f.write("\t".join(map(str, row)) + "\n")
    outputs["files.tsv"] = {"sha256": hashlib.sha256((out / "files.tsv").read_bytes()).hexdigest()}

    tot_bytes = sum(stats[c][s]["bytes"] for c in CATS for s in ("train", "heldout"))
    per = {}
    for c in CATS:
        per[c] = {}
        for s in ("train", "heldout"):
            per[c][s] = dict(stats[c][s], tokens=token_counts[c][s])
        per[c]["bytes_by_source"] = {}
        for row in listing:
            if row[1] == c:
                k = "repo" if row[2] == "repo" else f"{row[2]} {row[4]}"
                per[c]["bytes_by_source"][k] = per[c]["bytes_by_source"].get(k, 0) + row[5]
        per[c]["share_target"] = mix[c]
        per[c]["share_actual"] = round(filled[c] / tot_bytes, 4) if tot_bytes else 0.0
    manifest = {
        "generator": "tools/ftheta_corpus.py",
        "python": sys.version.split()[0], "python_full": sys.version, "executable": sys.executable,
        "platform": platform.platform(),
        "roots": {"stdlib": stdlib, "site": sites, "repo_text": [] if a.no_repo_text else
                  ["data/codec/calib.txt", "data/codec/eval.txt"]},
        "options": {"max_mb": a.max_mb, "heldout": a.heldout, "seed": a.seed, "mix": mix,
                    "min_bytes": a.min_bytes, "max_file_kb": a.max_file_kb, "docstrings": not a.no_docstrings,
                    "dir_cap": a.dir_cap,
                    "doc_max_bytes": DOC_MAX, "separator": SEP,
                    "split_rule": "sha256('<label>/<rel>') % 10000 < heldout*10000 -> heldout (repo text: train)"},
        "token_count": ("tokenizer " + os.path.basename(a.tokenizer) + " sha256 " +
                        hashlib.sha256(Path(a.tokenizer).read_bytes()).hexdigest()) if a.tokenizer else "bytes/4",
        "exclude": {"dirs": [os.path.relpath(d, REPO) if Path(d).resolve().is_relative_to(REPO) else d
                             for d in excl_dirs],
                    "eval_files": len(ex.files), "eval_chars": sum(map(len, ex.texts)),
                    "window": 64, "refused": overlap_files},
        "categories": per,
        "totals": {s: {"docs": outputs[f"{s}.txt"]["docs"], "bytes": outputs[f"{s}.txt"]["bytes"],
                       "tokens": sum(token_counts[c][s] for c in CATS)} for s in ("train", "heldout")},
        "skipped": skipped,
        "candidates": {c: len([x for x in cands[c] if x[4] == "file"]) for c in CATS},
        "outputs": outputs,
        "seconds": {"exclude_index": round(t_index, 2), "enumerate": round(t_enum, 2),
                    "tokenize": round(t_tok, 2), "total": round(time.time() - t_start, 2)},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for c in CATS:
        print(f"[ftheta_corpus] {c:10s} train {per[c]['train']['bytes'] / 1e6:6.2f} MB {per[c]['train']['tokens']:>9} tok"
              f" | heldout {per[c]['heldout']['bytes'] / 1e6:5.2f} MB {per[c]['heldout']['tokens']:>8} tok"
              f" | share {per[c]['share_actual']:.3f} (target {mix[c]:.2f})", file=sys.stderr)
    print(f"[ftheta_corpus] wrote {out}/train.txt ({outputs['train.txt']['docs']} docs), heldout.txt "
          f"({outputs['heldout.txt']['docs']} docs); refused {len(overlap_files)} overlapping eval text; "
          f"{time.time() - t_start:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
