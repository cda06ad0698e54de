"""How far can a KV-aligned trainer get to the engine with an fp8 KV cache? (CPU)

The H200 test (tests/gpu/test_kv_cache_alignment.py) measured the trainer-engine
mismatch KL with a BF16 KV cache (the floor, 3.1e-4), with an fp8_e4m3 cache and a plain trainer
(2.2e-3) and with the KV-aligned trainer (1.5e-3: 4.9x the floor). This bench asks whether exact
rounding rules can reach the floor at all when the trainer's values before rounding differ from
the engine's by kernel noise.

Model: ``--layers`` residual blocks of causal attention (``te_quant.kv_attention.
rollout_kv_attention``: prompt rows read fresh K/V, decode rows the rounded cache, as SGLang's
Triton backend does) and a ReLU MLP with random weights, then a vocabulary head. The "engine" is
the model as is; the "trainer" is the same model whose every block output carries a relative
Gaussian error ``eps`` (what different kernels and summation orders give; BF16 rounding is
~2^-9 relative). For each ``eps`` it prints the exact KL(engine || trainer) over the response
positions for (a) BF16 KV in both (the floor), (b) fp8 KV in the engine, plain trainer, (c) fp8
KV in the engine, KV-aligned trainer — and the ratio (c)/(a).

If rounding flips drive (c), the ratio grows as eps shrinks (flip rate ~ eps / fp8 step, each
flip a whole fp8 step: variance ~ eps, while the floor's variance ~ eps^2).

    python bench/kv_flip_noise.py [--layers 4] [--seeds 3]
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from megatron_qrl.te_quant.kv_attention import rollout_kv_attention


def _model(seed: int, d: int, heads: int, layers: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, fan: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / math.sqrt(fan)

    return {"emb": torch.randn(vocab, d, generator=g), "head": w(vocab, d, fan=d),
            "blocks": [{"qkv": w(3 * d, d, fan=d), "o": w(d, d, fan=d), "up": w(4 * d, d, fan=d),
                        "down": w(d, 4 * d, fan=4 * d)} for _ in range(layers)], "heads": heads}


def _logp(m: dict, ids: torch.Tensor, prompt: int, kv: str, eps: float,
          g: torch.Generator | None) -> torch.Tensor:
    x = m["emb"][ids]                                    # [b, s, d]
    b, s, d = x.shape
    h = m["heads"]
    cache_from = torch.full((b,), prompt)

    def noisy(t: torch.Tensor) -> torch.Tensor:
        if eps == 0 or g is None:
            return t
        return t * (1 + eps * torch.randn(t.shape, generator=g))

    for blk in m["blocks"]:
        z = F.rms_norm(x, (d,))
        q, k, v = (z @ blk["qkv"].T).view(b, s, 3, h, d // h).permute(2, 0, 3, 1, 4)
        att = rollout_kv_attention(q, noisy(k), noisy(v), cache_from, kv, (d // h) ** -0.5)
        x = x + noisy(att.transpose(1, 2).reshape(b, s, d) @ blk["o"].T)
        z = F.rms_norm(x, (d,))
        x = x + noisy(F.relu(z @ blk["up"].T) @ blk["down"].T)
    return torch.log_softmax(F.rms_norm(x, (d,)) @ m["head"].T, dim=-1)[:, prompt - 1:-1]


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p.exp() * (p - q)).sum(-1).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=192)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--eps", default="1e-2,2e-3,4e-4,8e-5")
    args = ap.parse_args()
    torch.set_default_dtype(torch.float64)   # the model's own arithmetic adds no noise
    print("| eps | floor KL (bf16 KV) | fp8 KV, plain trainer | fp8 KV, KV-aligned trainer "
          "| aligned / floor |\n|---|---|---|---|---|")
    for eps in map(float, args.eps.split(",")):
        rows = []
        for seed in range(args.seeds):
            m = _model(seed, args.dim, args.heads, args.layers, 512)
            ids = torch.randint(0, 512, (4, args.prompt + args.response),
                                generator=torch.Generator().manual_seed(100 + seed))
            eng_bf, eng_fp8 = (_logp(m, ids, args.prompt, kv, 0.0, None)
                               for kv in ("bf16", "fp8_e4m3"))
            tr = {kv: _logp(m, ids, args.prompt, kv, eps, torch.Generator().manual_seed(7 + seed))
                  for kv in ("bf16", "fp8_e4m3")}
            rows.append((_kl(eng_bf, tr["bf16"]), _kl(eng_fp8, tr["bf16"]),
                         _kl(eng_fp8, tr["fp8_e4m3"])))
        f, p, a = (sum(r[i] for r in rows) / len(rows) for i in range(3))
        print(f"| {eps:.0e} | {f:.2e} | {p:.2e} | {a:.2e} | {a / f:.1f} |")


if __name__ == "__main__":
    main()
