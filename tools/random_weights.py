"""Random weights of a model's real shape, the same values as core/model/random_weights.h.

Every tensor of the HF model (its checkpoint name, e.g. model.layers.0.experts.gate_up_proj) is
drawn from its own generator on the model's device, seeded by the name and the run's seed:
  t = randn(shape, generator, f32) * scale + base, then rounded to the parameter's dtype,
scale = 1/sqrt(shape[-1]), base = 0 for matrices; scale = 0.1, base = 1 for vectors.
So `kakeya bench decode --random-init` and HF transformers time identical weights; for speed
and plumbing only, never for quality."""
import math

import torch

_MASK = (1 << 64) - 1


def weight_seed(name: str, seed: int) -> int:
    h = 14695981039346656037
    for c in name.encode():
        h = ((h ^ c) * 1099511628211) & _MASK
    return (h ^ seed) & 0x7FFFFFFFFFFFFFFF


def random_weight(name, shape, seed, device):
    g = torch.Generator(device=device).manual_seed(weight_seed(name, seed))
    t = torch.randn(tuple(shape), generator=g, device=device, dtype=torch.float32)
    matrix = len(shape) >= 2
    return t.mul_(1.0 / math.sqrt(shape[-1]) if matrix else 0.1).add_(0.0 if matrix else 1.0)


@torch.no_grad()
def fill(model, seed):
    """Overwrite every tensor the checkpoint would hold (parameters, tied ones once, and the
    persistent buffers) by its checkpoint name."""
    seen = set()
    persistent = set(model.state_dict().keys())
    tensors = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if n in persistent]
    for name, t in tensors:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        t.copy_(random_weight(name, t.shape, seed, t.device).to(t.dtype))
