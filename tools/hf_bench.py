#!/usr/bin/env python3
"""HF transformers peer for `kakeya bench decode`: greedy generate of exactly
--new-tokens tokens from the given prompt ids, with the default (dynamic) cache
and with the static cache, batch 1. Prints one JSON object last (with the
greedy tokens of the default-cache run).

--random-init CONFIG --seed S: no checkpoint; the model of that config with the
weights `kakeya bench decode --random-init` draws (tools/random_weights.py)."""
import argparse, json, time, statistics
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from random_weights import fill


def main():
    ap = argparse.ArgumentParser()
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model")
    src.add_argument("--random-init", help="HF config.json: random weights of its shape")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ids", required=True, help="JSON array of prompt ids")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    if a.random_init:
        j = json.load(open(a.random_init))
        cfg = AutoConfig.for_model(j.pop("model_type"), **j)
        with torch.device(a.device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        fill(model, a.seed)
        model.eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).to(a.device).eval()
    ids = torch.tensor([json.load(open(a.ids))], device=a.device)
    out = {"transformers": __import__("transformers").__version__, "torch": torch.__version__}

    def sync():
        if a.device == "cuda":
            torch.cuda.synchronize()

    for name, kw in (("default", {}), ("static", {"cache_implementation": "static"})):
        gen = dict(max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False, **kw)
        with torch.inference_mode():
            model.generate(ids, **gen)  # warm-up (static cache: allocation)
            e2e, prefill = [], []
            for _ in range(a.repeats):
                sync(); t0 = time.perf_counter()
                model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, **kw)
                sync(); t1 = time.perf_counter()
                toks = model.generate(ids, **gen)
                sync(); t2 = time.perf_counter()
                prefill.append(t1 - t0)
                e2e.append(t2 - t1)
        e = statistics.median(e2e); p = statistics.median(prefill)
        out[f"{name}_e2e_tps"] = a.new_tokens / e
        out[f"{name}_decode_tps"] = (a.new_tokens - 1) / max(e - p, 1e-9)
        if name == "default":
            out["tokens"] = toks[0, ids.shape[1]:].tolist()
        print(f"[hf_bench] {name}: {out[f'{name}_e2e_tps']:.1f} tok/s end to end", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
