"""Weights used by the quantization tests (deterministic, CPU)."""

import torch

QUANT_NAME = "model.layers.0.mlp.experts.3.down_proj.weight"


def gaussian(out=256, k=384, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(out, k, generator=g) * 0.02).to(dtype)


def heavy_tailed(out=256, k=384, dtype=torch.float32, seed=1):
    """Student-t (3 dof) weights with a few large outliers, like LLM projections."""
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):  # StudentT draws from the global RNG: seed it here
        torch.manual_seed(seed)              # (the data depended on the tests run before)
        t = torch.distributions.StudentT(3.0).sample((out, k))
    idx = torch.randint(0, out * k, (out * k // 1000,), generator=g)
    t.view(-1)[idx] *= 20
    return (t * 0.02).to(dtype)
