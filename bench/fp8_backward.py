#!/usr/bin/env python3
"""FP8 backward GEMMs (dgrad, wgrad) of the aligned linears vs BF16: gradient effect and speed.

    python bench/fp8_backward.py                          # CPU: gradients, dense + MoE
    python bench/fp8_backward.py --speed-only             # CUDA: the speed A/B alone

1. Gradients (any device; the CPU runs ``torch._scaled_mm`` on the CPU): a tiny random Qwen3
   (dense) and Qwen3-MoE (stacked experts), BF16, the aligned forward for ``fp8`` on the real
   GEMM, one forward + backward of the next-token cross-entropy (``--batch`` x ``--seq``
   random tokens), once per backward: ``bf16`` (``--qrl-train-aligned-backward bf16``), the
   FP8 dgrad and the FP8 wgrad (``--qrl-train-aligned-wgrad fp8``) alone with the gradient
   quantized to E4M3 and to E5M2, and both together (E4M3), :data:`VARIANTS`. Per parameter and for the
   input gradient (the embedding output's): cosine similarity and relative L2 error
   ``|g - g_bf16| / |g_bf16|`` to the BF16 backward; a summary line per model and element type.
2. Speed (CUDA only): one aligned linear ``y = Q_a(x) Q_w(W)^T`` (fp8, real GEMM) at Qwen3-4B
   shapes, forward + backward (dgrad and wgrad), median ms over ``--reps`` of CUDA-event
   timings: BF16 backward vs FP8 dgrad, FP8 wgrad and both, and their ratios to BF16.

Records: one JSON line per row with ``--out PATH`` (temp file + rename), commit included.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES_4B = {"qkv": (2560, 6144), "o_proj": (4096, 2560), "gate_up": (2560, 19456),
             "down": (9728, 2560)}
"""Qwen3-4B linears (in, out): hidden 2560, 32 query / 8 KV heads of 128, FFN 9728."""
VARIANTS = (("dgrad", "e4m3"), ("dgrad", "e5m2"), ("wgrad", "e4m3"), ("wgrad", "e5m2"),
            ("dgrad+wgrad", "e4m3"))
"""(which backward GEMMs run in FP8, gradient element type) compared with the BF16 backward."""
_MOE_ONLY = ("num_experts", "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step",
             "mlp_only_layers", "moe_intermediate_size")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kinds", default="dense,moe", help="tiny models: dense, moe")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the tiny models")
    p.add_argument("--tokens", type=int, default=8192, help="speed A/B: rows of x (tokens)")
    p.add_argument("--reps", type=int, default=20, help="speed A/B: timed repetitions")
    p.add_argument("--speed-only", action="store_true", help="skip the gradient comparison")
    p.add_argument("--quiet", action="store_true", help="summary lines only (no per parameter)")
    p.add_argument("--out", default=None, help="write the rows as JSON lines here")
    return p.parse_args(argv)


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def tiny_arch(kind: str, layers: int = 2):
    """The format-friendly tiny Qwen3-MoE of ``data/configs`` (hidden 256, 8 experts top-2)
    or its dense twin (FFN 512), with ``layers`` decoder layers."""
    from megatron_qrl.models import CONFIG_DIR
    from megatron_qrl.models.hf_config import arch_from_dict

    cfg = json.loads((CONFIG_DIR / "quant_report_qwen3_moe.json").read_text())
    cfg["num_hidden_layers"] = layers
    if kind == "dense":
        cfg = {k: v for k, v in cfg.items() if k not in _MOE_ONLY}
        cfg.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    return arch_from_dict(cfg)


def build(kind: str, device: str, seed: int, layers: int = 2):
    """(state, model) with the aligned fp8 forward on the real GEMM (inside a megatron job)."""
    from megatron_qrl.models.runtime import build_model
    from megatron_qrl.models.stacked_experts import stacked_experts_spec_hook
    from megatron_qrl.te_quant import AlignedForwardState, aligned_spec_hook, compose_hooks

    torch.manual_seed(seed)
    state = AlignedForwardState("fp8", gemm="real")
    hook = compose_hooks(stacked_experts_spec_hook if kind == "moe" else None,
                         aligned_spec_hook(state))
    extra = {"use_cpu_initialization": False} if device != "cpu" else {}
    model = build_model(tiny_arch(kind, layers), None, torch.bfloat16, spec_hook=hook, use_te=False,
                        **extra)
    return state, model.to(device)


def gradients(state, model, ids: torch.Tensor, backward: str, fmt: str, wgrad: str = "bf16"
              ) -> dict[str, torch.Tensor]:
    """Every parameter's gradient and the input gradient (``<input>``, the embedding output's)
    after one forward + backward of the next-token cross-entropy, fp32; ``backward`` /
    ``wgrad``: the dgrad / wgrad GEMM (``bf16`` or ``fp8`` in element type ``fmt``)."""
    state.backward, state.wgrad, state.grad_format = backward, wgrad, fmt
    model.zero_grad(set_to_none=True)
    seen: list[torch.Tensor] = []

    def keep_grad(_module, _inputs, out: torch.Tensor) -> None:
        out.register_hook(lambda g: seen.append(g.detach().float()))

    h = model.embedding.register_forward_hook(keep_grad)
    try:
        pos = torch.arange(ids.shape[1], device=ids.device)[None].expand_as(ids)
        logits = model(ids, pos, attention_mask=None).float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
    finally:
        h.remove()
    out = {"<input>": seen[0]}
    out.update({n: p.grad.detach().float().clone() for n, p in model.named_parameters()
                if p.grad is not None})
    return out


def compare(a: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(cosine similarity, relative L2 error ``|a - ref| / |ref|``), fp64."""
    a, ref = a.double().flatten(), ref.double().flatten()
    cos = torch.nn.functional.cosine_similarity(a, ref, dim=0).item()
    return cos, ((a - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def gradient_rows(kind: str, args: argparse.Namespace, device: str) -> list[dict]:
    state, model = build(kind, device, args.seed, args.layers)
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, model.vocab_size, (args.batch, args.seq), generator=g).to(device)
    ref = gradients(state, model, ids, "bf16", "e4m3")
    rows = []
    for gemms, fmt in VARIANTS:
        got = gradients(state, model, ids, "fp8" if "dgrad" in gemms else "bf16", fmt,
                        "fp8" if "wgrad" in gemms else "bf16")
        for name, r in ref.items():
            cos, rel = compare(got[name], r)
            rows.append({"model": kind, "layers": args.layers, "gemms": gemms, "grad_fp8": fmt,
                         "param": name, "cosine": cos, "rel_l2": rel})
    return rows


def print_gradient_rows(rows: list[dict], quiet: bool) -> None:
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["param"]), {})[f"{r['gemms']} {r['grad_fp8']}"] = r
    fmts = list(dict.fromkeys(f"{r['gemms']} {r['grad_fp8']}" for r in rows))
    if not quiet:
        head = "".join(f" | {f} cos | {f} rel L2" for f in fmts)
        print(f"| model | gradient{head} |")
        print("|---|---" + "|---:" * 2 * len(fmts) + "|")
        for (model, param), cells in by.items():
            vals = "".join(f" | {cells[f]['cosine']:.6f} | {cells[f]['rel_l2']:.2e}" for f in fmts)
            print(f"| {model} | {param}{vals} |")
    for model in dict.fromkeys(r["model"] for r in rows):
        for f in fmts:
            sel = [r for r in rows if r["model"] == model and f"{r['gemms']} {r['grad_fp8']}" == f]
            inp = next(r for r in sel if r["param"] == "<input>")
            print(f"{model} {f}: input gradient cos {inp['cosine']:.6f} rel {inp['rel_l2']:.2e}; "
                  f"parameters min cos {min(r['cosine'] for r in sel):.6f} max rel "
                  f"{max(r['rel_l2'] for r in sel):.2e} median rel "
                  f"{statistics.median(r['rel_l2'] for r in sel):.2e}")


def time_linear(k: int, n: int, m: int, grad_fp8: str | None, reps: int,
                wgrad_fp8: str | None = None) -> float:
    """Median ms of forward + backward of one aligned fp8 linear on the real GEMM."""
    from megatron_qrl.quant import get_spec
    from megatron_qrl.te_quant.real_gemm import real_linear, weight_operand

    spec = get_spec("fp8")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16().requires_grad_()
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    qw = weight_operand(spec, w)  # once per optimizer step, outside the timing
    times = []
    for i in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        real_linear(x, w, qw, spec, grad_fp8=grad_fp8, wgrad_fp8=wgrad_fp8).backward(g)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
        x.grad = w.grad = None
    return statistics.median(times)


def speed_rows(args: argparse.Namespace) -> list[dict]:
    from megatron_qrl.te_quant.fp8_backward import GRAD_FORMAT

    rows = []
    for name, (k, n) in SHAPES_4B.items():
        bf16 = time_linear(k, n, args.tokens, None, args.reps)
        fp8 = time_linear(k, n, args.tokens, GRAD_FORMAT, args.reps)
        wgrad = time_linear(k, n, args.tokens, None, args.reps, GRAD_FORMAT)
        both = time_linear(k, n, args.tokens, GRAD_FORMAT, args.reps, GRAD_FORMAT)
        rows.append({"linear": name, "in": k, "out": n, "tokens": args.tokens,
                     "bf16_backward_ms": bf16, "fp8_backward_ms": fp8, "ratio": fp8 / bf16,
                     "fp8_wgrad_ms": wgrad, "wgrad_ratio": wgrad / bf16,
                     "fp8_dgrad_wgrad_ms": both, "dgrad_wgrad_ratio": both / bf16})
        print(f"{name} [{args.tokens} x {k}] -> {n}: fwd+bwd bf16 backward {bf16:.3f} ms, "
              f"fp8 dgrad {fp8:.3f} ms ({fp8 / bf16:.3f}), fp8 wgrad {wgrad:.3f} ms "
              f"({wgrad / bf16:.3f}), fp8 dgrad+wgrad {both:.3f} ms ({both / bf16:.3f})")
    return rows


def write(path: str, rows: list[dict]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    from megatron_qrl.models.runtime import single_process_megatron

    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.speed_only and not cuda:
        print("--speed-only needs CUDA (torch._scaled_mm on a GPU); none here")
        return 2
    rows: list[dict] = []
    head = {"commit": commit(), "device": torch.cuda.get_device_name() if cuda else "cpu"}
    if not args.speed_only:
        kinds = [k for k in args.kinds.split(",") if k]
        bad = sorted(set(kinds) - {"dense", "moe"})
        if bad:
            print(f"--kinds: unknown {bad}; choose from dense, moe")
            return 2
        with single_process_megatron():
            grad = [r for kind in kinds for r in gradient_rows(kind, args,
                                                               "cuda" if cuda else "cpu")]
        print_gradient_rows(grad, args.quiet)
        rows += [{**head, "what": "gradient", **r} for r in grad]
    if cuda:
        rows += [{**head, "what": "speed", **r} for r in speed_rows(args)]
    else:
        print("speed A/B skipped: no CUDA (run on the GPU)")
    if args.out:
        write(args.out, rows)
    print(f"commit {head['commit']} on {head['device']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
