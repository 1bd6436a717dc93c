#!/usr/bin/env python3
"""Long-context EVALUATION texts (data/longeval/): sources that are no Python package.

The f_θ training corpus (tools/ftheta_corpus.py) is built from a Python
installation (stdlib, site-packages) plus data/codec/*.txt; the evaluation
texts here come from elsewhere on a Debian machine:

  docs/NN.txt        long single documents for teacher-forced perplexity of the
                     last 512 tokens at contexts up to 16k. Each is the head of
                     one source cut at a line boundary once it holds at least
                     --doc-tokens tokens (real tokenizer, no BOS). Four kinds:
                       man        man pages rendered to text by man-db/groff
                                  (man --nj --nh -P cat, MANWIDTH=80, col -bx)
                       pod        Perl POD rendered by pod2text -w 80
                       info       GNU Texinfo manuals (/usr/share/info), node
                                  headers, menus and the tag table removed
                       changelog  upstream ChangeLogs from /usr/share/doc
  haystack_eval.txt  one paragraph of natural prose per line, for
                     needle-in-a-haystack haystacks (kakeya niah --haystack):
                     paragraphs of DESCRIPTION-like text of many other man pages
                     (sections 1, 5, 7, 8; sorted by path, taken in page order),
                     re-flowed to one line each and filtered to sentences
                     (capital start, full stop end, no option/markup/path
                     characters, no long digit runs, no "magic number"),
                     without licence/credit/bug-report sections or sentences.
  Everywhere: tabs expanded, trailing blanks removed, blank lines squeezed, and
  runs of one repeated non-word character ("=====", "-----", padding) cut to 24
  characters (a window of nothing but '=' would match any file with a rule).
  sources.json       every source file with its sha256, the tool versions, each
                     output's sha256, bytes and token count.

The outputs are committed so that every machine evaluates the same bytes (CI and
the GPU machine need none of the tools); rerun this script only to regenerate
them (on Debian 12: apt-get install -y man-db groff-base perl). tests/corpus_disjoint.py
proves that no 64-character window of these texts occurs in the training corpus.

Usage: longeval_corpus.py --tokenizer checkpoints/models/gemma3-270m/tokenizer.json [--out data/longeval]
"""
import argparse, gzip, hashlib, json, os, re, subprocess, sys, time
from pathlib import Path

# (kind, source path). Order = output numbering docs/00.txt, 01.txt, ...
DOCS = [
    ("man", "/usr/share/man/man1/bash.1.gz"),
    ("man", "/usr/share/man/man5/proc.5.gz"),
    ("man", "/usr/share/man/man1/curl.1.gz"),
    ("pod", "/usr/share/perl/5.36.0/pod/perldiag.pod"),
    ("pod", "/usr/share/perl/5.36.0/CPAN.pm"),
    ("info", "/usr/share/info/coreutils.info.gz"),
    ("info", "/usr/share/info/gettext.info.gz"),
    ("changelog", "/usr/share/doc/libmpfr6/changelog.gz"),
    ("changelog", "/usr/share/doc/strace/changelog.gz"),
]
HAYSTACK_SECTIONS = ["man1", "man5", "man7", "man8"]
# Families of near-identical pages (one generator, many pages) and Python-related pages.
HAYSTACK_SKIP = re.compile(r"^(gcloud|git|perf|cmake|ctest|cpack|py|python|pip|pydoc|idle|2to3|openssl|llvm|clang|x86_64|"
                           r"systemd|dh_|debconf|dpkg|apt)", re.I)


def sha256_bytes(b):
    return hashlib.sha256(b).hexdigest()


# Runs of one repeated non-word character (rules "=====", "-----", table padding) are cut
# to MAX_RUN: otherwise a 64-character window of nothing but '=' or ' ' would be "shared"
# with any training file that has such a rule, which says nothing about leakage.
MAX_RUN = 24
RUN = re.compile(r"([^\w\n])\1{%d,}" % MAX_RUN)


def tidy(text):
    """Tabs expanded, runs cut to MAX_RUN, trailing blanks off, at most one blank line in a row,
    ends with one newline."""
    lines = [RUN.sub(lambda m: m.group(1) * MAX_RUN, l.expandtabs(8).rstrip())
             for l in text.replace("\r\n", "\n").split("\n")]
    out, blank = [], 0
    for l in lines:
        blank = blank + 1 if not l else 0
        if blank <= 1:
            out.append(l)
    while out and not out[0]:
        out.pop(0)
    return "\n".join(out).rstrip("\n") + "\n"


def render_man(path):
    env = dict(os.environ, MANWIDTH="80", LC_ALL="C.UTF-8", MAN_KEEP_FORMATTING="0")
    r = subprocess.run(["man", "--nj", "--nh", "-E", "UTF-8", "-P", "cat", "-l", path], env=env,
                       capture_output=True, check=True)
    r = subprocess.run(["col", "-bx"], input=r.stdout, env=env, capture_output=True, check=True)
    return r.stdout.decode("utf-8", "replace")


def render_pod(path):
    r = subprocess.run(["pod2text", "-w", "80", path], capture_output=True, check=True,
                       env=dict(os.environ, LC_ALL="C.UTF-8"))
    return r.stdout.decode("utf-8", "replace")


def render_info(path):
    raw = gzip.open(path).read().decode("utf-8", "replace") if path.endswith(".gz") else Path(path).read_text()
    nodes = raw.split("\x1f")
    out = []
    for node in nodes[1:]:  # nodes[0]: preamble (makeinfo banner, dir entries)
        body = node.lstrip("\n")
        if body.startswith("Tag Table:") or body.startswith("End Tag Table") or body.startswith("Local Variables"):
            continue
        lines = body.split("\n")
        if lines and lines[0].startswith("File: "):
            if "Node: Top," in lines[0]:
                continue  # the Top node is a table of contents
            lines = lines[1:]  # "File: x.info,  Node: ..., Next: ..." navigation header
        keep, in_menu = [], False
        for l in lines:
            if l.startswith("* Menu:"):
                in_menu = True
                continue
            if in_menu:
                if l.startswith("* ") or l.startswith("   ") or not l.strip():
                    continue
                in_menu = False
            keep.append(l)
        out.append("\n".join(keep))
    return "\n\n".join(out)


def render_changelog(path):
    raw = gzip.open(path).read() if path.endswith(".gz") else Path(path).read_bytes()
    return raw.decode("utf-8", "replace")


RENDER = {"man": render_man, "pod": render_pod, "info": render_info, "changelog": render_changelog}


def head_tokens(text, tok, min_tokens):
    """Shortest prefix of whole lines holding at least min_tokens tokens (the whole text if shorter)."""
    lines = text.split("\n")
    # Prefix sums of per-line token counts overestimate nothing by much; confirm on the real prefix.
    counts = [len(e.ids) for e in tok.encode_batch([l + "\n" for l in lines], add_special_tokens=False)]
    acc, cut = 0, len(lines)
    for i, c in enumerate(counts):
        acc += c
        if acc >= min_tokens:
            cut = i + 1
            break
    while True:
        prefix = "\n".join(lines[:cut]).rstrip("\n") + "\n"
        n = len(tok.encode(prefix, add_special_tokens=False).ids)
        if n >= min_tokens or cut >= len(lines):
            return prefix, n
        cut += max(1, (min_tokens - n) // 20)


PROSE_BAD = re.compile(r"--|[=<>{}\[\]|\\$`@#^~_*/]|\d{5,}|\.\.\.|https?:|magic number", re.I)


# Sections and sentences of boilerplate (licences, credits, bug addresses): text that
# also heads countless source files and says nothing about a page.
SKIP_SECTIONS = re.compile(r"^(COPYRIGHT|COPYING|LICEN[CS]E|AUTHORS?|REPORTING BUGS|BUGS|SEE ALSO|COLOPHON|"
                           r"AVAILABILITY|TRADEMARKS|ACKNOWLEDGE?MENTS?|CONTRIBUTORS|THANKS)\b")
BOILERPLATE = re.compile(r"warranty|licen[cs]e|copyright|free software|public domain|redistribut|"
                         r"permission is granted|all rights reserved|written by|maintained by|report bugs", re.I)


def haystack_paragraphs(text):
    """Paragraphs of a rendered man page re-flowed to one line each, kept when they read as prose."""
    out = []
    section = ""
    for block in re.split(r"\n\s*\n", text):
        lines = block.split("\n")
        while lines and lines[0].strip() and not lines[0].startswith(" "):
            section = lines.pop(0).strip()  # a heading (unindented line) opens a section
        if not lines or SKIP_SECTIONS.match(section):
            continue
        # Re-flow only blocks whose lines share one indentation (running text, not tables/lists).
        ind = {len(l) - len(l.lstrip(" ")) for l in lines if l.strip()}
        if len(ind) != 1:
            continue
        p = " ".join(l.strip() for l in lines if l.strip())
        p = re.sub(r"\s+", " ", p)
        if not (100 <= len(p) <= 1200) or not p[0].isupper() or not p.endswith("."):
            continue
        if PROSE_BAD.search(p) or BOILERPLATE.search(p) or p.isupper():
            continue
        letters = sum(c.isalpha() or c == " " for c in p)
        if letters < 0.9 * len(p) or any(ord(c) > 0x2ff and c not in "‘’“”–—" for c in p):
            continue
        if len(p.split()) < 15:
            continue
        out.append(p)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "data" / "longeval"))
    ap.add_argument("--doc-tokens", type=int, default=17200, help="minimum tokens of each document (default 17200)")
    ap.add_argument("--haystack-kb", type=int, default=420, help="haystack size to collect (default 420 KB)")
    a = ap.parse_args()
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(a.tokenizer)
    t0 = time.time()
    out = Path(a.out)
    (out / "docs").mkdir(parents=True, exist_ok=True)
    for old in (out / "docs").glob("*.txt"):
        old.unlink()
    ver = lambda cmd: subprocess.run(cmd, capture_output=True, text=True).stdout.split("\n")[0].strip()
    manifest = {
        "generator": "tools/longeval_corpus.py",
        "tools": {"man": ver(["man", "--version"]), "groff": ver(["groff", "--version"]),
                  "pod2text": ver(["perl", "-MPod::Text", "-e", "print $Pod::Text::VERSION"])},
        "tokenizer": os.path.basename(a.tokenizer),
        "tokenizer_sha256": sha256_bytes(Path(a.tokenizer).read_bytes()),
        "doc_min_tokens": a.doc_tokens,
        "docs": [],
    }
    used = set()
    for i, (kind, src) in enumerate(DOCS):
        text = tidy(RENDER[kind](src))
        full = len(tok.encode(text, add_special_tokens=False).ids)
        doc, n = head_tokens(text, tok, a.doc_tokens)
        if n < a.doc_tokens:
            sys.exit(f"{src}: only {n} tokens (< {a.doc_tokens})")
        name = f"docs/{i:02d}.txt"
        (out / name).write_text(doc)
        used.add(os.path.realpath(src))
        manifest["docs"].append({
            "file": name, "kind": kind, "source": src, "source_sha256": sha256_bytes(Path(src).read_bytes()),
            "source_tokens_rendered": full, "tokens": n, "bytes": len(doc.encode()),
            "sha256": sha256_bytes(doc.encode()), "first_line": doc.split("\n", 1)[0].strip()})
        print(f"{name} {kind:9s} {n:6d} tok {len(doc.encode()):7d} B  (of {full} tok)  {src}", file=sys.stderr)

    # Haystack.
    paras, seen, hay_src = [], set(), []
    budget = a.haystack_kb * 1000
    total = 0
    pages = []
    for sec in HAYSTACK_SECTIONS:
        d = Path("/usr/share/man") / sec
        pages += sorted(p for p in d.glob("*.gz") if p.is_file() and not p.is_symlink())
    for p in pages:
        if total >= budget:
            break
        if HAYSTACK_SKIP.match(p.name) or os.path.realpath(p) in used or p.stat().st_size < 3000:
            continue
        try:
            text = render_man(str(p))
        except subprocess.CalledProcessError:
            continue
        got = []
        for q in haystack_paragraphs(text):
            h = q.lower()
            if h in seen:
                continue
            seen.add(h)
            got.append(q)
        if len(got) < 3:  # a page with one or two stray sentences adds no coherent run
            continue
        paras += got
        total += sum(len(q.encode()) + 1 for q in got)
        hay_src.append({"source": str(p), "sha256": sha256_bytes(p.read_bytes()), "paragraphs": len(got),
                        "tokens": sum(len(e.ids) for e in tok.encode_batch([q + "\n" for q in got],
                                                                            add_special_tokens=False))})
    hay = "\n".join(paras) + "\n"
    (out / "haystack_eval.txt").write_text(hay)
    ht = len(tok.encode(hay, add_special_tokens=False).ids)
    manifest["haystack"] = {
        "file": "haystack_eval.txt", "kind": "man (prose paragraphs, one per line)",
        "sections": HAYSTACK_SECTIONS, "skip_name_regex": HAYSTACK_SKIP.pattern,
        "lines": len(paras), "bytes": len(hay.encode()), "tokens": ht, "sha256": sha256_bytes(hay.encode()),
        "sources": hay_src}
    manifest["total_bytes"] = sum(d["bytes"] for d in manifest["docs"]) + len(hay.encode())
    (out / "sources.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    print(f"haystack_eval.txt {len(paras)} lines {len(hay.encode())} B {ht} tok from {len(hay_src)} man pages; "
          f"total {manifest['total_bytes']} B; {time.time() - t0:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
