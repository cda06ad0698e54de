#!/usr/bin/env python3
"""Training step time of the rollout-aligned forward (QaRL) vs the plain BF16 forward, side by side.

    python bench/aligned_step.py --formats int8,fp8,fp8_block,w4a16,nvfp4 \
        --micro-batch 4 --seq-len 1024 --warmup 2 --rounds 8 --out bench/results/aligned_step.jsonl
    python bench/aligned_step.py --tiny --warmup 1 --rounds 2      # CPU smoke run, seconds

Every model is a megatron-core ``GPTModel`` built by ``rl.trainer.build_policy`` from the
``ForwardPlan`` of ``rl.forward.forward_plan`` (the qrl-train path): megatron DDP, megatron Adam,
``--bf16`` parameters with fp32 masters on the GPU. A timed step is
``PolicyTrainer.train_step``: ``get_forward_backward_func()`` over the micro batches with the
real policy loss (``losses.megatron_adapter.PolicyLossFunc``, error-token filter on) on a
random batch, then ``optimizer.step()`` (which invalidates the aligned forward's cached
quantized weights, so every aligned step re-quantizes every weight once, as in training).

Variants (all timed in the same process, interleaved ABC..CBA.. per round):
- ``bf16``: the plain trainer forward (``--qrl-train-forward bf16``), its own model;
- ``bf16:off``: the aligned model with quantization switched off (``state.only(())``);
- ``aligned:FMT``: the aligned model (``--qrl-train-forward aligned``) for rollout format FMT
  (one model; its ``AlignedForwardState`` is switched to FMT before the step);
- ``aligned:FMT:per-expert``: the same, quantizing each expert's weights and W8A8 inputs in its
  own calls (``AlignedSequentialMLP.batched = False``; ``--per-expert FMTS``): the stacked
  quantization's gain, measured side by side;
- ``aligned:FMT:real``: the same aligned model running the real low-bit GEMM on the spec's
  codes and scales (``--qrl-train-aligned-gemm real``, ``te_quant.real_gemm``: fp8
  ``torch._scaled_mm``, int8 ``torch._int_mm``, fp8_block SGLang's own Triton block GEMM, its
  experts fake; ``--real FMTS``), same forward up to rounding;
  its operands (per-token activation codes, the backward's dequantized operands) and the
  once-per-step weight codes come from the fused Triton kernels where they run
  (``QRL_QUANT_IMPL`` auto: CUDA);
- ``aligned:FMT:real:bwd8``: the real GEMM with both backward GEMMs in FP8 as well
  (``--qrl-train-aligned-backward fp8 --qrl-train-aligned-wgrad fp8``, ``te_quant.fp8_backward``;
  ``--real-fp8-backward``, fp8 only): every GEMM of the aligned linears FP8;
- ``aligned:FMT:real:torch``: the same with ``QRL_QUANT_IMPL=torch`` for the step (the torch
  reference ops instead of the fused kernels; ``--real-torch-operands``), side by side; with
  ``--real-fp8-backward`` also ``aligned:fp8:real:bwd8:torch`` (the gradients' quantization in
  torch instead of ``quant/triton_grad.py``);
  (the fake-quant variants' per-token activations take the same kernels under auto);
- ``te:FMT``: the Transformer Engine recipe path (``te_quant.te_recipes``), only when TE
  imports and a recipe reproduces FMT on this GPU, or differs only by rounding (path "te
  (rounding differs)": TE fp8_block, measured on the H200; its numerics are not the rollout's).
The ratio is median step time / median of ``bf16`` (``bf16:off`` when the plain model was
not built). MFU: ``6 * active parameters * tokens / step time / 989 TFLOP/s`` (the H200's
dense BF16 peak, ``bench/rl_step.py``'s ``PEAK_FLOPS``; the same peak for the low-bit rows, so
their MFU is comparable to the BF16 row's). Peak memory: ``torch.cuda.max_memory_allocated`` during the step (reset before;
every model stays resident, so it includes all of them) and the step's own part (peak minus
the memory allocated when the step started).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

TINY_CONFIG = ROOT / "megatron_qrl" / "data" / "configs" / "tiny_qwen3_moe.json"
FORMATS = ("int8", "fp8", "fp8_block", "w4a16", "nvfp4")

GPU_MOE = {  # a Qwen3-30B-A3B layer (hidden 2048, top-8, moe_intermediate 768), fewer layers/experts
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "mlp_only_layers": [],
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 6,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true",
                   help=f"the shipped tiny Qwen3-MoE ({TINY_CONFIG.name}); seconds on a CPU")
    p.add_argument("--config", default=None,
                   help="an HF config.json (Qwen3-MoE / Qwen3) instead of the built-in GPU shape")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--experts", type=int, default=None, help="override num_experts")
    p.add_argument("--formats", default=",".join(FORMATS),
                   help="rollout formats of the aligned variants (comma separated)")
    p.add_argument("--per-expert", default="",
                   help="formats (of --formats) also timed with per-expert quantizer calls, "
                        "the path before stacking (comma separated)")
    p.add_argument("--real", default="",
                   help="comma-separated formats (in --formats) also timed with the real low-bit "
                        "GEMM (aligned:FMT:real); fp8 needs CUDA sm >= 89, int8 CUDA (or the CPU), "
                        "fp8_block CUDA sm >= 89 with SGLang importable")
    p.add_argument("--real-torch-operands", action="store_true",
                   help="also time each --real format with the torch operand code instead of "
                        "the fused Triton kernels (aligned:FMT:real:torch, QRL_QUANT_IMPL=torch)")
    p.add_argument("--real-fp8-backward", action="store_true",
                   help="also time --real fp8 with the FP8 input and weight gradients "
                        "(aligned:fp8:real:bwd8: --qrl-train-aligned-backward fp8 "
                        "--qrl-train-aligned-wgrad fp8)")
    p.add_argument("--no-te-variants", action="store_true",
                   help="skip the te:FMT recipe models (each is one more model in GPU memory)")
    p.add_argument("--micro-batch", type=int, default=None, help="rows per micro batch (4; tiny: 2)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per row (1024; tiny: 32)")
    p.add_argument("--num-micro-batches", type=int, default=1,
                   help="micro batches per optimizer step (the quantized weights are cached "
                        "across them, re-quantized once per step)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps per variant after the first (probe) step")
    p.add_argument("--rounds", type=int, default=6, help="timed steps per variant (interleaved)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="parameter dtype (GPU: bf16 with fp32 masters, as --bf16; CPU: fp32)")
    p.add_argument("--plain-model", choices=("auto", "yes", "no"), default="auto",
                   help="build the plain bf16 model (auto: if two models fit the GPU)")
    p.add_argument("--loss-kind", default="decoupled", help="PolicyLossConfig.kind")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="append one JSONL record per variant here")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, profile one step per variant (torch.profiler) and print "
                        "its N most expensive ops (device time on a GPU, CPU time otherwise)")
    return p.parse_args(argv)


def load_config(args: argparse.Namespace) -> dict[str, Any]:
    """The HF config dict of the benchmarked model (``--tiny`` / ``--config`` / built-in)."""
    if args.tiny and args.config:
        raise SystemExit("--tiny and --config exclude each other")
    path = TINY_CONFIG if args.tiny else args.config
    cfg = json.loads(Path(path).read_text()) if path else dict(GPU_MOE)
    if args.layers is not None:
        cfg["num_hidden_layers"] = args.layers
    if args.experts is not None:
        cfg["num_experts"] = args.experts
    return cfg


def commit() -> str:
    """The benchmarked checkout's HEAD (``.commit`` first: a device copy's git HEAD can be
    stale; ``unknown`` outside a git checkout)."""
    import subprocess

    stamp = ROOT / ".commit"
    if stamp.is_file():
        return stamp.read_text().strip()

    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def check_real(real: list[str], formats: list[str], cuda: bool) -> None:
    """``--real`` names formats in ``--formats`` that have a real GEMM on this device."""
    from megatron_qrl.quant import get_spec
    from megatron_qrl.te_quant.real_gemm import device_info, select_gemm

    if set(real) - set(formats):
        raise SystemExit(f"--real {sorted(set(real) - set(formats))}: not in --formats")
    for fmt in real:
        try:
            select_gemm(get_spec(fmt), device_info(), "real")
        except ValueError as exc:
            raise SystemExit(f"--real {fmt}: {exc}") from None


@contextlib.contextmanager
def megatron_world(cuda: bool):
    """One-rank megatron job: NCCL through ``torchrun_megatron`` on a GPU, gloo + CPU shim else."""
    from megatron_qrl.models import runtime

    if not cuda:
        with runtime.single_process_megatron():
            yield
        return
    from megatron_qrl.compat.distributed import free_port

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port()))):
        os.environ.setdefault(key, value)
    with runtime.torchrun_megatron():
        yield


def make_batch(vocab: int, rows: int, seq: int, n_micro: int, device: str, seed: int) -> list[dict]:
    """Random policy-loss micro batches (second half of each row is the "response")."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_micro):
        tokens = torch.randint(0, vocab, (rows, seq + 1), generator=gen)
        mask = torch.zeros(rows, seq, dtype=torch.bool)
        mask[:, seq // 2:] = True
        lp = -torch.rand(rows, seq, generator=gen) * 4.0
        mb = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask,
              "position_ids": torch.arange(seq).expand(rows, seq),
              "old_log_probs": lp, "rollout_log_probs": lp - 0.01 * torch.rand(rows, seq, generator=gen),
              "advantages": torch.randn(rows, generator=gen)}
        out.append({k: v.contiguous().to(device) for k, v in mb.items()})
    return out


@dataclass
class Variant:
    """One timed configuration: a trainer and what to switch before its step."""

    name: str
    path: str
    """plain | fake-quant | te."""
    trainer: Any
    fmt: str = "bf16"
    state: Any = None
    """The shared ``AlignedForwardState`` of the aligned model (None: nothing to switch)."""
    batched: bool = True
    """``AlignedSequentialMLP.batched`` during the step (aligned model only)."""
    gemm: str = "fake"
    """``AlignedForwardState.gemm`` during the step: fake or real (aligned model only)."""
    quant_impl: str | None = None
    """``QRL_QUANT_IMPL`` during the step (None: the process's setting)."""
    backward: str = "bf16"
    """``AlignedForwardState.backward`` and ``.wgrad`` during the step (real GEMM only)."""
    ran_backward: str = "bf16"
    """What the state held during the last step (``backward/wgrad``), for the record."""
    times: list[float] = field(default_factory=list)
    peaks: list[float] = field(default_factory=list)
    step_mem: list[float] = field(default_factory=list)

    @contextlib.contextmanager
    def context(self) -> Any:
        from megatron_qrl.quant.fused import set_quant_impl

        if self.quant_impl is not None:
            set_quant_impl(self.quant_impl)
        try:
            with self._switch():
                if self.state is not None:
                    self.ran_backward = f"{self.state.backward}/{self.state.wgrad}"
                yield
        finally:
            if self.quant_impl is not None:
                set_quant_impl(None)

    def _switch(self) -> Any:
        if self.state is None:
            return contextlib.nullcontext()
        from megatron_qrl.te_quant.linears import AlignedSequentialMLP

        for m in self.trainer.module.modules():
            if isinstance(m, AlignedSequentialMLP):
                m.batched = self.batched
        self.state.backward = self.state.wgrad = self.backward
        if self.fmt == "bf16":
            return self.state.only(())
        from megatron_qrl.quant import get_spec

        if self.state.spec.name != self.fmt or self.state.gemm != self.gemm:
            self.state.spec = get_spec(self.fmt)
            self.state.gemm = self.gemm
            self.state.mark_weights_updated()  # drop the other format's / GEMM's cache
        return contextlib.nullcontext()


def _configs(forward: str, fmt: str) -> Any:
    from megatron_qrl.config import QrlConfigs
    from megatron_qrl.config.run import RolloutConfig, RoutingReplayConfig, TrainForwardConfig

    return QrlConfigs(train=TrainForwardConfig(forward), routing=RoutingReplayConfig("off"),
                      rollout=RolloutConfig(format=fmt))


def build_trainer(arch: Any, plan: Any, args: argparse.Namespace, cuda: bool) -> Any:
    """``build_policy`` of ``plan`` (re-seeded: every model starts from the same weights)."""
    import torch
    from megatron.core import tensor_parallel

    from megatron_qrl.rl.trainer import PolicyTrainer, build_policy

    if cuda:  # models.builder sets CPU initialisation when TE is missing (a CPU host's need):
        # on a GPU it would leave RoPE's inv_freq on the CPU
        plan.config_overrides.setdefault("use_cpu_initialization", False)
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    with torch.device("cuda") if cuda else contextlib.nullcontext():
        # the local spec's norms are torch.nn.RMSNorm, created on the default device
        policy = build_policy(arch, args.lr, plan, bf16=args.dtype == "bf16")
    return PolicyTrainer(policy)


def te_formats(formats: list[str], cuda: bool) -> tuple[list[str], str]:
    """Formats with a TE recipe here, and why the others have none."""
    from megatron_qrl.models.builder import use_transformer_engine
    from megatron_qrl.te_quant import te_recipe_for

    if not (cuda and use_transformer_engine()):
        return [], "Transformer Engine not importable (or no GPU): TE variants skipped"
    ok, why = [], []
    for fmt in formats:
        try:
            te_recipe_for(fmt, approximate=True)
            ok.append(fmt)
        except ValueError as exc:
            why.append(f"{fmt}: {str(exc).split(';')[0]}")
    return ok, "; ".join(why)


def plain_fits(arch: Any, args: argparse.Namespace, cuda: bool,
               others: int = 1) -> tuple[bool, str, int, int]:
    """Whether to build the plain bf16 model beside ``others`` models (the fake-quant one, and
    one per ``te:`` variant), and the parameter counts."""
    import torch

    from megatron_qrl.models.runtime import meta_parameter_counts

    total, active = meta_parameter_counts(arch)
    if args.plain_model != "auto":
        return args.plain_model == "yes", f"--plain-model {args.plain_model}", total, active
    if not cuda:
        return True, "CPU", total, active
    per = 18 if args.dtype == "bf16" else 16  # param + fp32 grad + fp32 master + Adam m, v
    models = others + 1
    need = (models * per + 2) * total + 20 * 2**30  # the models, Q(W) cache, activations margin
    have = torch.cuda.get_device_properties(0).total_memory
    return (need < have, f"{models} models need ~{need / 2**30:.0f} GiB of {have / 2**30:.0f}",
            total, active)


def build_variants(arch: Any, args: argparse.Namespace, cuda: bool, formats: list[str],
                   notes: list[str]) -> list[Variant]:
    from megatron_qrl.rl.forward import ForwardPlan, forward_plan
    from megatron_qrl.te_quant import RECIPES, trainer_forward

    variants = []
    te_ok, te_why = ([], "--no-te-variants") if args.no_te_variants else te_formats(formats, cuda)
    fits, why, total, active = plain_fits(arch, args, cuda, others=1 + len(te_ok))
    notes.append(f"parameters: {total / 1e6:,.1f} M total, {active / 1e6:,.1f} M active")
    if fits:
        notes.append(f"plain bf16 model built ({why})")
        plain = forward_plan(_configs("bf16", "bf16"), arch)
        variants.append(Variant("bf16", "plain", build_trainer(arch, plain, args, cuda)))
    else:
        notes.append(f"plain bf16 model not built ({why}); baseline is bf16:off")
    plan = forward_plan(_configs("aligned", formats[0]), arch)
    aligned = build_trainer(arch, plan, args, cuda)
    variants.append(Variant("bf16:off", "fake-quant (off)", aligned, "bf16", plan.aligned))
    variants += [Variant(f"aligned:{f}", "fake-quant", aligned, f, plan.aligned) for f in formats]
    variants += [Variant(f"aligned:{f}:per-expert", "fake-quant, per expert", aligned, f,
                         plan.aligned, batched=False) for f in args.per_expert if f in formats]
    for f in args.real:
        variants.append(Variant(f"aligned:{f}:real", "real GEMM", aligned, f, plan.aligned,
                                gemm="real"))
        if args.real_fp8_backward and f == "fp8":
            variants.append(Variant(f"aligned:{f}:real:bwd8", "real GEMM, FP8 backward",
                                    aligned, f, plan.aligned, gemm="real", backward="fp8"))
            if args.real_torch_operands:
                variants.append(Variant(f"aligned:{f}:real:bwd8:torch",
                                        "real GEMM, FP8 backward, torch operands", aligned, f,
                                        plan.aligned, gemm="real", backward="fp8",
                                        quant_impl="torch"))
        if args.real_torch_operands:
            variants.append(Variant(f"aligned:{f}:real:torch", "real GEMM, torch operands",
                                    aligned, f, plan.aligned, gemm="real", quant_impl="torch"))
    if te_why:
        notes.append(te_why)
    for fmt in te_ok:
        cfg = _configs("aligned", fmt)
        fwd = trainer_forward(cfg["train"], fmt, cfg["routing"], arch, te_recipe="approximate")
        te_plan = ForwardPlan(fwd.spec_hook, None, fwd.replay, dict(fwd.config_overrides))
        path = "te" if RECIPES[fmt].matches_spec else "te (rounding differs)"
        variants.append(Variant(f"te:{fmt}", path, build_trainer(arch, te_plan, args, cuda), fmt))
    return variants


def timed_step(v: Variant, mbs: list[dict], loss_fn: Any, cuda: bool) -> tuple[float, float, float]:
    """``(seconds, peak GiB, step GiB)`` of one ``train_step`` of ``v``."""
    import torch

    with v.context():
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        v.trainer.train_step(mbs, loss_fn)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    if not cuda:
        return dt, float("nan"), float("nan")
    peak = torch.cuda.max_memory_allocated()
    return dt, peak / 2**30, (peak - base) / 2**30


def probe(variants: list[Variant], mbs: list[dict], loss_fn: Any, cuda: bool,
          notes: list[str]) -> list[Variant]:
    """One untimed step per variant; a format the model's shapes do not allow is dropped."""
    kept = []
    for v in variants:
        try:
            timed_step(v, mbs, loss_fn, cuda)
        except ValueError as exc:
            if v.path == "plain" or v.fmt == "bf16":
                raise
            notes.append(f"{v.name} skipped: {exc}")
            continue
        kept.append(v)
    return kept


def profile_steps(variants: list[Variant], mbs: list[dict], loss_fn: Any, cuda: bool,
                  top: int) -> dict[str, list[dict]]:
    """One profiled step per variant: ``{variant: [{op, calls, ms}] of its top ops}`` (where
    the aligned step's extra time goes: activation fake-quant, re-quantization, ...)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    key = "device_time_total" if cuda else "cpu_time_total"
    out = {}
    for v in variants:
        with profile(activities=acts) as prof:
            timed_step(v, mbs, loss_fn, cuda)
        ev = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)[:top]
        out[v.name] = [{"op": e.key, "calls": e.count, "ms": round(getattr(e, key) / 1e3, 3)}
                       for e in ev]
        print(f"profile {v.name}: " + "; ".join(f"{r['op']} x{r['calls']} {r['ms']} ms"
                                               for r in out[v.name]))
    return out


def run_rounds(variants: list[Variant], mbs: list[dict], loss_fn: Any, args: argparse.Namespace,
               cuda: bool) -> None:
    """Warm-up, then ``args.rounds`` interleaved rounds (forward order, then reversed)."""
    for v in variants:
        for _ in range(args.warmup):
            timed_step(v, mbs, loss_fn, cuda)
    for r in range(args.rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            dt, peak, step = timed_step(v, mbs, loss_fn, cuda)
            v.times.append(dt)
            v.peaks.append(peak)
            v.step_mem.append(step)


def records(variants: list[Variant], meta: dict[str, Any], flops: float = 0.0
            ) -> list[dict[str, Any]]:
    """One record per variant: median step time, ratio to the baseline, MFU (``flops`` per
    step over the peak), memory."""
    from rl_step import PEAK_FLOPS

    from megatron_qrl.quant.fused import quant_impl

    base = next(v for v in variants if v.name in ("bf16", "bf16:off"))
    base_med = statistics.median(base.times)
    out = []
    for v in variants:
        med = statistics.median(v.times)
        out.append({**meta, "variant": v.name, "format": v.fmt, "path": v.path,
                    "quant_impl": v.quant_impl or quant_impl(), "backward": v.ran_backward,
                    "median_step_s": med, "ratio_to_baseline": med / base_med,
                    "mfu": round(flops / med / PEAK_FLOPS, 4),
                    "baseline": base.name, "times_s": v.times,
                    "peak_gib": max(v.peaks), "step_gib": max(v.step_mem)})
    return out


def table(recs: list[dict[str, Any]]) -> str:
    """Markdown table of :func:`records`."""
    base = recs[0]["baseline"]

    def gib(x: float) -> str:
        return "n/a" if x != x else f"{x:.1f}"

    lines = [f"| variant | path | median step s | ratio to {base} | MFU | peak GiB | step GiB |",
             "|---|---|---|---|---|---|---|"]
    for r in recs:
        lines.append(f"| {r['variant']} | {r['path']} | {r['median_step_s']:.4f} | "
                     f"{r['ratio_to_baseline']:.3f} | {r['mfu']:.3f} | {gib(r['peak_gib'])} | "
                     f"{gib(r['step_gib'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import torch

    from megatron_qrl.losses import PolicyLossConfig
    from megatron_qrl.losses.error_tokens import ErrorTokenConfig
    from megatron_qrl.losses.megatron_adapter import PolicyLossFunc
    from megatron_qrl.models import arch_from_dict
    from megatron_qrl.quant import list_specs

    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)  # tiny GEMMs: no thread spin-waits on a shared 2-core host
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.micro_batch = args.micro_batch or (2 if args.tiny else 4)
    args.seq_len = args.seq_len or (32 if args.tiny else 1024)
    formats = [f for f in args.formats.split(",") if f]
    args.per_expert = [f for f in args.per_expert.split(",") if f]
    if set(args.per_expert) - set(formats):
        raise SystemExit(f"--per-expert {sorted(set(args.per_expert) - set(formats))}: "
                         "not in --formats")
    bad = [f for f in formats if f not in list_specs() or f == "bf16"]
    if bad or not formats:
        raise SystemExit(f"--formats {args.formats}: {bad or 'empty'}; choose from "
                         f"{[f for f in list_specs() if f != 'bf16']}")
    args.real = [f for f in args.real.split(",") if f]
    check_real(args.real, formats, cuda)
    if args.real_fp8_backward and "fp8" not in args.real:
        raise SystemExit("--real-fp8-backward times --real fp8 with FP8 gradients: add fp8 to "
                         "--real")
    if args.rounds < 1 or args.warmup < 0:
        raise SystemExit("--rounds must be >= 1 and --warmup >= 0")
    cfg = load_config(args)
    arch = arch_from_dict(cfg, "--tiny" if args.tiny else (args.config or "built-in GPU shape"))
    notes: list[str] = []
    with megatron_world(cuda):
        variants = build_variants(arch, args, cuda, formats, notes)
        loss_fn = PolicyLossFunc(PolicyLossConfig(kind=args.loss_kind), ErrorTokenConfig())
        mbs = make_batch(arch.vocab_size, args.micro_batch, args.seq_len, args.num_micro_batches,
                         "cuda" if cuda else "cpu", args.seed)
        variants = probe(variants, mbs, loss_fn, cuda, notes)
        run_rounds(variants, mbs, loss_fn, args, cuda)
        profiles = profile_steps(variants, mbs, loss_fn, cuda, args.profile) if args.profile else {}
    device = torch.cuda.get_device_name() if cuda else "cpu"
    meta = {"bench": "aligned_step", "device": device, "commit": commit(), "tiny": args.tiny,
            "layers": arch.num_layers, "hidden": arch.hidden_size, "experts": arch.num_experts,
            "top_k": arch.moe_top_k, "vocab": arch.vocab_size, "dtype": args.dtype,
            "micro_batch": args.micro_batch, "seq_len": args.seq_len,
            "num_micro_batches": args.num_micro_batches, "warmup": args.warmup,
            "rounds": args.rounds, "loss": f"policy loss {args.loss_kind} + error tokens "
            "(PolicyTrainer.train_step: forward + backward + Adam step)", "notes": notes}
    from rl_step import active_params

    tokens = args.num_micro_batches * args.micro_batch * args.seq_len
    recs = records(variants, meta, 6.0 * active_params(cfg) * tokens)
    for r in recs:
        if r["variant"] in profiles:
            r["profile_top_ops"] = profiles[r["variant"]]
    print(f"device: {device}; {arch.num_layers} layers, hidden {arch.hidden_size}, "
          f"{arch.num_experts} experts top-{arch.moe_top_k}; {args.dtype}; batch "
          f"{args.num_micro_batches} x {args.micro_batch} x {args.seq_len}; step = {meta['loss']}")
    for note in notes:
        print(f"note: {note}")
    print(table(recs))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as fh:
            for r in recs:
                fh.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
