#!/usr/bin/env python3
"""The PyTorch eager f_θ training step that `kakeya bench train-ftheta` times
next to ours, on the same batch, f_θ weights and options (written by the bench
into --dir). The loss is tools/ftheta_ref.py (the definitions of
train/ftheta_loss.h with HF transformers' Gemma 3 modules, attention through
scaled_dot_product_attention as the seeds' prototype did), bf16 autocast on
CUDA as ours, gradient clipping, torch.optim.AdamW (fused on CUDA), and one
host sync per step (the finite check), as ours.

  ftheta_step_ref.py --dir D --verifier MODEL_DIR --device cuda --steps 20 --warmup 5 --json OUT.json
"""
import argparse, json, sys, time
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import Gemma3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ftheta_ref import loss_case  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--verifier", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    dev = torch.device(a.device)
    d_dir = Path(a.dir)
    o = json.loads((d_dir / "options.json").read_text())
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as ours (setAllowTF32CuBLAS)
    model = Gemma3ForCausalLM.from_pretrained(a.verifier, dtype=torch.float32).to(dev).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    cfg = model.config
    batch = {k: v.to(dev) for k, v in load_file(d_dir / "batch.safetensors").items()}
    W = {k: v.to(dev).requires_grad_(True) for k, v in load_file(d_dir / "ftheta" / "f_theta.safetensors").items()}
    mats = [p for p in W.values() if p.dim() >= 2]
    vecs = [p for p in W.values() if p.dim() < 2]
    ad = o["adamw"]
    opt = torch.optim.AdamW([{"params": mats, "weight_decay": ad["weight_decay"]}, {"params": vecs, "weight_decay": 0.0}],
                            lr=o["lr"], betas=(ad["beta1"], ad["beta2"]), eps=ad["eps"], fused=dev.type == "cuda")
    case = dict(loss=o["loss"], sink=o["sink"], window=o["window"], lambdas=o["lambdas"])
    params = list(W.values())

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    loss0, t0 = None, None
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            sync()
            t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda" and o["autocast"]):
            loss, _ = loss_case(model, cfg, W, batch, case, sdpa=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, ad["grad_clip"])
        if not torch.isfinite(loss.detach() + gn):  # one host sync per step, as ours
            raise SystemExit(f"non-finite loss or gradient at step {i}")
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i == 0:
            loss0 = loss.item()
    sync()
    dt = time.perf_counter() - t0
    out = dict(step_ms=1e3 * dt / a.steps, steps=a.steps, warmup=a.warmup, loss0=loss0, torch=torch.__version__,
               attention="scaled_dot_product_attention")
    Path(a.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
