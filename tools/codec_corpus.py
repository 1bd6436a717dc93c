#!/usr/bin/env python3
"""Calibration and evaluation text for the KV codec (kakeya calibrate / codec-eval).

Source: the Python Language Reference prose that ships in CPython's standard
library as pydoc_data/topics.py (Debian package libpython3.11-stdlib, file
/usr/lib/python3.11/pydoc_data/topics.py): 79 topics, ~470k characters of
English technical prose with some grammar and code snippets.

Split (disjoint by construction, by topic): topics are sorted by name and topic
number i goes to evaluation when i % 4 == 0, to calibration otherwise. No
evaluation sentence can appear in the calibration text (checked below on
every 200-character window of the evaluation text; evaluation paragraphs
that the reference repeats under a calibration topic are dropped).

The outputs are committed (data/codec/{calib,eval}.txt + sources.json) so that
the CPU and the GPU machine evaluate exactly the same bytes whatever Python
they have; rerun this script only to regenerate them.

Usage: codec_corpus.py [--topics /usr/lib/python3.11/pydoc_data/topics.py] [--out data/codec]
"""
import argparse, hashlib, json, runpy
from pathlib import Path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--topics", default="/usr/lib/python3.11/pydoc_data/topics.py")
    ap.add_argument("--out", default="data/codec")
    a = ap.parse_args()
    topics = runpy.run_path(a.topics)["topics"]
    names = sorted(topics)
    ev = [n for i, n in enumerate(names) if i % 4 == 0]
    ca = [n for i, n in enumerate(names) if i % 4 != 0]
    # Topics are separated by a blank line; each already starts with its title.
    join = lambda ns: "\n\n".join(topics[n].strip() for n in ns) + "\n"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = {"eval": join(ev), "calib": join(ca)}
    cal = texts["calib"]
    norm = lambda s: " ".join(s.split())
    ncal = norm(cal)
    # Some reference sections are repeated under several topics: drop every
    # evaluation paragraph that also occurs in the calibration text.
    paras = texts["eval"].split("\n\n")
    kept = [p for p in paras if len(norm(p)) < 40 or norm(p) not in ncal]
    texts["eval"] = e = "\n\n".join(kept)
    dropped = len(paras) - len(kept)
    # Disjointness: no 200-char window of eval prose (whitespace-normalised) occurs in calib.
    ne = norm(e)
    dup = sum(1 for i in range(0, max(0, len(ne) - 200), 200) if ne[i:i + 200] in ncal)
    for k, t in texts.items():
        (out / f"{k}.txt").write_text(t)
    src = {
        "source": a.topics,
        "source_sha256": hashlib.sha256(Path(a.topics).read_bytes()).hexdigest(),
        "rule": "topics sorted by name; index % 4 == 0 -> eval, else calib",
        "eval_topics": ev, "calib_topics": ca,
        "eval_chars": len(e), "calib_chars": len(cal),
        "eval_sha256": hashlib.sha256(e.encode()).hexdigest(),
        "calib_sha256": hashlib.sha256(cal.encode()).hexdigest(),
        "eval_paragraphs_dropped_as_duplicates": dropped,
        "eval_windows_found_in_calib": dup,
    }
    (out / "sources.json").write_text(json.dumps(src, indent=2) + "\n")
    print(json.dumps({k: v for k, v in src.items() if not k.endswith("topics")}, indent=2))


if __name__ == "__main__":
    main()
