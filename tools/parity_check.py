#!/usr/bin/env python3
"""Our runtime vs HF transformers on the same machine, device and dtype:
perplexity of a prose passage (same token ids) and greedy continuations of
three prompts. Prints a table and writes JSON.

  tools/parity_check.py --model DIR --kakeya build/kakeya --device cuda --dtype bf16 --json OUT
"""
import argparse, json, math, os, subprocess, sys, tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fixtures"))
from make_real_model_fixtures import PROMPTS, N_NEW, passage  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--kakeya", default="build/kakeya")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dt).to(a.device).eval()
    tmp = Path(tempfile.mkdtemp())
    res = {"device": a.device, "dtype": a.dtype, "model": a.model}

    ids = tok(passage(), return_tensors="pt").input_ids.to(a.device)
    with torch.no_grad():
        lg = model(ids).logits[0, :-1].float()
    lp = torch.log_softmax(lg, -1).gather(1, ids[0, 1:, None])[:, 0]
    hf_ppl = math.exp(float(-lp.mean()))
    (tmp / "ids.json").write_text(json.dumps(ids[0].tolist()))
    subprocess.run([a.kakeya, "score", "--model", a.model, "--ids", str(tmp / "ids.json"), "--device", a.device,
                    "--dtype", a.dtype, "--json", str(tmp / "score.json")], check=True, stdout=subprocess.DEVNULL)
    ours = json.loads((tmp / "score.json").read_text())
    res["hf_ppl"], res["kakeya_ppl"] = hf_ppl, ours["perplexity"]
    res["ppl_rel_diff"] = abs(ours["perplexity"] - hf_ppl) / hf_ppl
    ours_lp = torch.tensor(ours["logprobs"], dtype=torch.float64)
    res["max_abs_logprob_diff"] = float((ours_lp - lp.double().cpu()).abs().max())

    res["generations"] = []
    for p in PROMPTS:
        pid = tok(p, return_tensors="pt").input_ids.to(a.device)
        with torch.no_grad():
            g = model.generate(pid, max_new_tokens=N_NEW, do_sample=False)[0, pid.shape[1]:].tolist()
        subprocess.run([a.kakeya, "generate", "--model", a.model, "--prompt", p, "--max-new-tokens", str(N_NEW),
                        "--device", a.device, "--dtype", a.dtype, "--json", str(tmp / "gen.json")], check=True,
                       stdout=subprocess.DEVNULL)
        o = json.loads((tmp / "gen.json").read_text())["generated_ids"]
        same = next((i for i, (x, y) in enumerate(zip(g, o)) if x != y), min(len(g), len(o)))
        res["generations"].append({"prompt": p, "hf": g, "kakeya": o, "identical_prefix": same,
                                   "identical": g == o})
    print(f"{'device':8} {'dtype':6} {'HF ppl':>9} {'ours ppl':>9} {'rel diff':>9} {'max |Δlogp|':>12}  greedy identical prefix")
    print(f"{a.device:8} {a.dtype:6} {hf_ppl:9.4f} {ours['perplexity']:9.4f} {res['ppl_rel_diff']:9.2e} "
          f"{res['max_abs_logprob_diff']:12.2e}  " + ", ".join(f"{g['identical_prefix']}/{N_NEW}" for g in res["generations"]))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
