#!/usr/bin/env python3
"""Our runtime vs HF transformers on the same machine, device and dtype:
perplexity of a prose passage (same token ids) and greedy continuations of
three prompts. Prints a table and writes JSON. Where a continuation parts
from HF's, it also records how close the step was: both tokens' logits in HF's
forward over the shared prefix (in the run's dtype and in f32), and how far HF's
own greedy runs agree when only the attention implementation changes (eager
against the default), since a bf16 near-tie moves with any change of summation
order.

  tools/parity_check.py --model DIR --kakeya build/kakeya --device cuda --dtype bf16 --json OUT
"""
import argparse, json, math, os, subprocess, sys, tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fixtures"))
from make_real_model_fixtures import PROMPTS, N_NEW, passage  # noqa: E402


def common_prefix(a, b):
    """How many leading tokens two continuations share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


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

    # HF against itself: the same weights and dtype, eager attention instead of the default.
    eager = AutoModelForCausalLM.from_pretrained(a.model, dtype=dt, attn_implementation="eager").to(a.device).eval()
    f32 = [model] if dt == torch.float32 else []  # an f32 copy, loaded the first time a continuation parts

    def divergence(pid, g, o, same):
        """Both tokens' logits at the first step where the continuations part (HF's forward over the
        prompt and the shared prefix): gap = logit(HF's token) - logit(ours)."""
        ctx = torch.cat([pid[0], torch.tensor(g[:same], device=pid.device, dtype=pid.dtype)])[None]
        if not f32:
            f32.append(AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).to(a.device).eval())
        with torch.no_grad():
            lg_dt = model(ctx).logits[0, -1].float()
            lg_32 = f32[0](ctx).logits[0, -1].float()
        top2 = torch.topk(lg_dt, 2).values
        return {"position": same, "hf_token": g[same], "kakeya_token": o[same],
                "gap": float(lg_dt[g[same]] - lg_dt[o[same]]), "top2_gap": float(top2[0] - top2[1]),
                "logit_scale": float(lg_dt[g[same]].abs()),
                "f32_gap": float(lg_32[g[same]] - lg_32[o[same]])}

    res["generations"] = []
    for p in PROMPTS:
        pid = tok(p, return_tensors="pt").input_ids.to(a.device)
        with torch.no_grad():
            g = model.generate(pid, max_new_tokens=N_NEW, do_sample=False)[0, pid.shape[1]:].tolist()
        subprocess.run([a.kakeya, "generate", "--model", a.model, "--prompt", p, "--max-new-tokens", str(N_NEW),
                        "--device", a.device, "--dtype", a.dtype, "--json", str(tmp / "gen.json")], check=True,
                       stdout=subprocess.DEVNULL)
        o = json.loads((tmp / "gen.json").read_text())["generated_ids"]
        same = common_prefix(g, o)
        with torch.no_grad():
            ge = eager.generate(pid, max_new_tokens=N_NEW, do_sample=False)[0, pid.shape[1]:].tolist()
        hf_self = common_prefix(g, ge)
        gen = {"prompt": p, "hf": g, "kakeya": o, "identical_prefix": same, "identical": g == o,
               "hf_eager": ge, "hf_eager_identical_prefix": hf_self}
        if same < min(len(g), len(o)):
            gen["divergence"] = divergence(pid, g, o, same)
        res["generations"].append(gen)
    print(f"{'device':8} {'dtype':6} {'HF ppl':>9} {'ours ppl':>9} {'rel diff':>9} {'max |Δlogp|':>12}  greedy identical prefix")
    print(f"{a.device:8} {a.dtype:6} {hf_ppl:9.4f} {ours['perplexity']:9.4f} {res['ppl_rel_diff']:9.2e} "
          f"{res['max_abs_logprob_diff']:12.2e}  " + ", ".join(f"{g['identical_prefix']}/{N_NEW}" for g in res["generations"]))
    print("HF eager attention against HF's default, greedy identical prefix: " +
          ", ".join(f"{g['hf_eager_identical_prefix']}/{N_NEW}" for g in res["generations"]))
    for i, g in enumerate(res["generations"]):
        d = g.get("divergence")
        if d:
            print(f"prompt {i + 1} parts at token {d['position']}: HF {d['hf_token']} vs ours {d['kakeya_token']}, "
                  f"logit gap {d['gap']:.4f} in HF's {a.dtype} forward (|logit| {d['logit_scale']:.1f}), "
                  f"{d['f32_gap']:.4f} in f32")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
