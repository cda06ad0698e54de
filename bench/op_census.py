#!/usr/bin/env python3
"""Op census of one train micro batch of a small Qwen3-MoE on the CPU: ops and host syncs.

    python bench/op_census.py                              # every variant, 2 and 4 layers
    python bench/op_census.py --variants plain,replay --experts 16 --top-k 4 --out c.jsonl

Builds the policy through the trainer's own path (``rl.cli.parse_configs`` ->
``rl.forward.forward_plan`` -> ``rl.trainer.build_policy``, the local spec,
``--qrl-train-moe-experts stacked``) for each variant's ``--qrl-*`` flags, runs one warm-up
``PolicyTrainer.train_step`` and then, under :class:`megatron_qrl.utils.op_census.OpCensus`:

- ``fwd+bwd``: one micro batch's forward + backward through ``PolicyTrainer._run`` (the
  megatron-core schedule, the policy loss) right after an optimizer step, so the aligned
  forward's once-per-step Q(W) refresh is in it;
- ``fwd+bwd again``: the next micro batch of the same step (the steady state);
- ``fwd+bwd +agreement``: a micro batch of the first update of an RL step, which also
  measures the routing agreement (``train_step(..., routing=True)``), and its total;
- ``optimizer``: the optimizer step (``rl.guard.guarded_step``; torch's Adam on the CPU, not
  the fused Adam a GPU runs) and the step's metrics (``rl.trainer.average_metrics``);
- ``recompute``: the log-prob (pi_prox) forward of one micro batch right after that optimizer
  step (``PolicyTrainer.log_probs``, no grad), and ``recompute again`` the next one.

Besides ops and syncs, per phase: the aligned forward's Q(W) refreshes (every aligned linear's
``qrl_recomputes``: once per optimizer step means in ``fwd+bwd`` / ``recompute`` only) and the
passes over the stacked expert weights (ops reading or writing a ``[experts, out, in]`` stack or
its ``[experts * out, in]`` row view) and over the permuted tokens (ops on a ``[tokens * top_k,
...]`` tensor), :class:`megatron_qrl.utils.op_census.OpCensus` ``kinds``. On the CPU the
quantizers run their torch reference (several ops, each a pass); a GPU runs each fused Triton
quantizer (``quant/triton_act.py``) as one.

A micro batch's tensors count as device tensors from the moment ``forward_step`` takes them
(the GPU trainer moves them there); the model's parameters, gradient buffers and optimizer
state are device tensors throughout. Ops per layer = (ops at ``--layers`` - ops at
``--layers`` / 2) / (``--layers`` / 2): the marginal cost of a decoder layer, forward and
backward. Prints one table of counts and one of every host sync with the frame that issued it
(upstream syncs with the line of ours that called into megatron-core).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASE = ["--qrl-loss-kind", "tis", "--qrl-rollout-engine", "reference", "--qrl-no-progress"]
PLAIN = ["--qrl-train-forward", "bf16", "--qrl-routing-replay", "off"]
"""The BF16 forward without replay (qrl-train's default preset, tiny-cpu, runs aligned int8
with replay in the recompute)."""
STACKED = [*PLAIN, "--qrl-train-moe-experts", "stacked"]
VARIANTS: dict[str, list[str]] = {
    "plain": STACKED,
    "replay": [*STACKED, "--qrl-routing-replay", "all"],
    "aligned-fp8": [*STACKED, "--qrl-train-forward", "aligned", "--qrl-rollout-format", "fp8",
                    "--qrl-train-aligned-gemm", "fake"],
    "aligned-fp8_block": [*STACKED, "--qrl-train-forward", "aligned", "--qrl-rollout-format",
                          "fp8_block", "--qrl-train-aligned-gemm", "fake"],
    "aligned-fp8-real": [*STACKED, "--qrl-train-forward", "aligned", "--qrl-rollout-format",
                         "fp8", "--qrl-train-aligned-gemm", "real"],
    "aligned-fp8-real-keep": [*STACKED, "--qrl-train-forward", "aligned", "--qrl-rollout-format",
                              "fp8", "--qrl-train-aligned-gemm", "real",
                              "--qrl-train-aligned-keep-dequantized"],
    "lora-sequential": [*PLAIN, "--qrl-lora-rank", "4", "--qrl-sft-steps", "0"],
}
"""Variant -> ``--qrl-*`` flags. LoRA runs on the sequential experts (megatron's
``SequentialMLP``): ``--qrl-train-moe-experts stacked`` with LoRA is refused
(``config.moe_path``). ``aligned-fp8-real``: the real FP8 GEMM forced on the CPU (torch's
``_scaled_mm``; the grouped experts then run one per expert: ``_scaled_grouped_mm`` is CUDA
only), to count its operand passes."""
PHASES = ("fwd+bwd", "fwd+bwd again", "fwd+bwd +agreement", "optimizer", "recompute",
          "recompute again")
MICRO_PHASES = ("fwd+bwd", "fwd+bwd again", "recompute", "recompute again")
"""The phases of one micro batch each (the passes table)."""
KINDS = ("expert weights", "permuted tokens")


def model_config(layers: int, experts: int, top_k: int) -> dict:
    """The tiny Qwen3-MoE of ``megatron_qrl/data/configs`` with these layers / experts / top-k,
    its widths 128 (fp8_block's 128-wide blocks divide every linear)."""
    cfg = json.loads((ROOT / "megatron_qrl/data/configs/tiny_qwen3_moe.json").read_text())
    cfg.update(num_hidden_layers=layers, num_experts=experts, num_experts_per_tok=top_k,
               hidden_size=128, head_dim=32, num_key_value_heads=4, moe_intermediate_size=128,
               intermediate_size=256)
    return cfg


def micro_batch(cfg: dict, samples: int, seq: int, seed: int = 0) -> dict:
    """A rollout-shaped micro batch (``rl.batch.pack_samples``) with advantages, pi_prox and
    the engine's routed experts (``[B, S, layers, top_k]``, distinct per token)."""
    from megatron_qrl.rl.batch import pack_samples

    g = torch.Generator().manual_seed(seed)
    vocab, layers, e, k = (cfg["vocab_size"], cfg["num_hidden_layers"], cfg["num_experts"],
                           cfg["num_experts_per_tok"])
    prompts = [torch.randint(1, vocab, (4,), generator=g).tolist() for _ in range(samples)]
    lens = [seq - 4 - (i % 3) for i in range(samples)]
    responses = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]
    lps = [-torch.rand(n, generator=g) for n in lens]
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    routed = torch.rand(samples, width, layers, e, generator=g).argsort(-1)[..., :k]
    mb = pack_samples(prompts, responses, lps, 0, routed)
    mb["advantages"] = torch.randn(samples, generator=g)
    mb["old_log_probs"] = mb["rollout_log_probs"].clone()
    return mb


class _DeviceBatches(list):
    """Micro batches whose tensors become device tensors when ``forward_step`` takes them
    (where the GPU trainer moves them), not when the trainer's host checks read them."""

    def __init__(self, items: list[dict], census) -> None:
        super().__init__(items)
        self.census = census

    def __iter__(self):
        census = self.census
        for mb in list.__iter__(self):
            if sys._getframe(1).f_code.co_name == "forward_step":
                census.mark_device(mb)
            yield mb


def _mark_trainer(census, trainer) -> None:
    """Parameters, gradient buffers and optimizer state are device tensors."""
    policy = trainer.policy
    for p in policy.ddp.module.parameters():
        census.mark_device([p] + [t for t in (p.grad, getattr(p, "main_grad", None))
                                  if t is not None])
    for buf in getattr(policy.ddp, "buffers", []) + getattr(policy.ddp, "expert_parallel_buffers",
                                                            []):
        census.mark_device([buf.grad_data, buf.param_data] if buf.param_data is not None
                           else [buf.grad_data])
    for opt in getattr(policy.optimizer, "chained_optimizers", None) or [policy.optimizer]:
        inner = getattr(opt, "optimizer", opt)
        for state in inner.state.values():
            census.mark_device([v for v in state.values() if torch.is_tensor(v)])
        for group in inner.param_groups:
            census.mark_device(list(group["params"]))


def tensor_kinds(cfg: dict, samples: int, seq: int) -> dict:
    """:data:`KINDS` as predicates on a tensor for ``cfg``'s MoE and a micro batch of
    ``samples`` x ``seq`` tokens: a stacked expert weight ``[E, out, in]`` (or its
    ``[E * out, in]`` rows), a permuted-token tensor ``[tokens * top_k, ...]`` (2-D or more)."""
    e, h, f = cfg["num_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    stacks = {(e, 2 * f, h), (e, h, f), (e * 2 * f, h), (e * h, f)}
    rows = samples * seq * cfg["num_experts_per_tok"]
    return {"expert weights": lambda t: tuple(t.shape) in stacks,
            "permuted tokens": lambda t: t.dim() >= 2 and t.shape[0] == rows}


def _refreshes(trainer) -> int:
    """Q(W) refreshes so far of every aligned linear (``qrl_recomputes``)."""
    return sum(getattr(m, "qrl_recomputes", 0) for m in trainer.module.modules())


def census_of(flags: list[str], cfg: dict, samples: int, seq: int):
    """``(OpCensus, PolicyTrainer)`` of one variant (module docstring); the census's
    ``refreshes`` holds the Q(W) refreshes per phase."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    from megatron_qrl.losses.megatron_adapter import PolicyLossFunc
    from megatron_qrl.models.hf_config import arch_from_dict
    from megatron_qrl.rl.cli import parse_configs
    from megatron_qrl.rl.forward import forward_plan
    from megatron_qrl.rl.guard import guarded_step
    from megatron_qrl.rl.trainer import (
        PolicyTrainer,
        TrainerOptions,
        average_metrics,
        build_policy,
    )
    from megatron_qrl.utils.op_census import OpCensus

    get_moe_layer_wise_logging_tracker().clear()  # sized by the first model's layer count
    configs = parse_configs([*BASE, *flags])[0]
    arch = arch_from_dict(cfg, source="op_census")
    torch.manual_seed(0)
    plan = forward_plan(configs, arch)
    trainer = PolicyTrainer(build_policy(arch, 1e-4, plan,
                                         options=TrainerOptions(transformer_impl="local")))
    loss_fn = PolicyLossFunc(configs["loss"], configs["error_tokens"])
    mbs = [micro_batch(cfg, samples, seq, seed) for seed in range(6)]
    trainer.train_step([mbs[0]], loss_fn)  # warm-up: lazy state, one optimizer step
    census = OpCensus(kinds=tensor_kinds(cfg, samples, seq))
    census.refreshes = {}
    _mark_trainer(census, trainer)
    ddp, optimizer = trainer.policy.ddp, trainer.policy.optimizer
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    store = []

    def phase(name, fn):
        before = _refreshes(trainer)
        with census.phase(name):
            out = fn()
        census.refreshes[name] = _refreshes(trainer) - before
        return out

    for name, mb in (("fwd+bwd", mbs[1]), ("fwd+bwd again", mbs[2])):
        store += phase(name, lambda mb=mb: trainer._run(_DeviceBatches([mb], census), loss_fn,
                                                        False))
    def agreement():  # the first update's micro batches in an RL step, and their total
        sink: list = []
        out = trainer._run(_DeviceBatches([mbs[3]], census), loss_fn, False, sink)
        trainer._routing_totals(sink)
        return out

    store += phase("fwd+bwd +agreement", agreement)
    _mark_trainer(census, trainer)
    phase("optimizer", lambda: (  # and the step's metrics, as train_step ends
        guarded_step(optimizer, store, trainer.guard, model_params=ddp.module.parameters()),
        average_metrics(store)))
    for name, mb in (("recompute", mbs[4]), ("recompute again", mbs[5])):
        phase(name, lambda mb=mb: trainer.log_probs(_DeviceBatches([mb], census), loss_fn))
    return census, trainer


def run_variant(name: str, layers: int, experts: int, top_k: int, samples: int,
                seq: int) -> dict:
    """One variant's record: ops per phase at ``layers`` and ``layers // 2``, per layer, syncs."""
    from megatron_qrl.models.runtime import single_process_megatron

    rec: dict = {"variant": name, "flags": " ".join(VARIANTS[name]), "layers": layers,
                 "experts": experts, "top_k": top_k, "tokens": samples * seq}
    counts = {}
    with single_process_megatron():
        for n in (layers // 2, layers):
            census, _ = census_of(VARIANTS[name], model_config(n, experts, top_k), samples, seq)
            counts[n] = {p: census.total_ops(p) for p in PHASES}
    half = layers - layers // 2
    rec["ops"] = counts[layers]
    rec["ops_per_layer"] = {p: (counts[layers][p] - counts[layers // 2][p]) / half
                            for p in PHASES}
    rec["syncs"] = {p: [vars(s) | {"owner": s.owner} for s in census.syncs(p)] for p in PHASES}
    rec["h2d"] = {p: len(census.phases[p].h2d) for p in PHASES}
    rec["qw_refreshes"] = dict(census.refreshes)
    rec["topk"] = {p: census.phases[p].ops["topk"] for p in PHASES}
    rec["passes"] = {p: {k: census.phases[p].passes[k] for k in KINDS} for p in PHASES}
    rec["h2d_frames"] = {p: sorted({s.frame for s in census.phases[p].h2d}) for p in PHASES}
    return rec


def _syncs(r: dict, phase: str) -> str:
    s = r["syncs"][phase]
    return f"{sum(x['owner'] == 'ours' for x in s)} / {sum(x['owner'] != 'ours' for x in s)}"


def tables(records: list[dict]) -> str:
    """The counts table (ops, ops per decoder layer, host syncs ours / upstream per phase) and
    the table of every sync with its frame (markdown)."""
    head = " | ".join(f"{p}: ops (per layer), syncs ours / upstream" for p in PHASES)
    lines = [f"| variant | {head} | H2D copies per micro batch |",
             "|---|" + "---|" * (len(PHASES) + 1)]
    for r in records:
        cells = " | ".join(f"{r['ops'][p]} ({r['ops_per_layer'][p]:.0f}), {_syncs(r, p)}"
                           for p in PHASES)
        lines.append(f"| {r['variant']} | {cells} | {r['h2d']['fwd+bwd again']} |")
    lines += ["", passes_table(records)]
    lines += ["", "| variant | phase | op | count | frame | our caller |",
              "|---|---|---|---|---|---|"]
    for r in records:
        for p in PHASES:
            seen: dict[tuple, int] = {}
            for s in r["syncs"][p]:
                key = (s["what"], s["frame"], s["ours"] or "-")
                seen[key] = seen.get(key, 0) + 1
            for (what, frame, ours), n in seen.items():
                lines.append(f"| {r['variant']} | {p} | {what} | {n} | {frame} | "
                             f"{'(same)' if ours == frame else ours} |")
    return "\n".join(lines)


def passes_table(records: list[dict]) -> str:
    """Markdown: per variant, the Q(W) refreshes and the passes over the expert weights and
    over the permuted tokens in each micro-batch phase (:data:`MICRO_PHASES`) and the step."""
    head = " / ".join(MICRO_PHASES)
    lines = [f"| variant | Q(W) refreshes: {head} / optimizer | expert-weight passes: {head} "
             f"| permuted-token passes: {head} |", "|---|---|---|---|"]
    for r in records:
        q = " / ".join(str(r["qw_refreshes"].get(p, 0)) for p in (*MICRO_PHASES, "optimizer"))
        cells = [" / ".join(str(r["passes"][p][k]) for p in MICRO_PHASES) for k in KINDS]
        lines.append(f"| {r['variant']} | {q} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (even, >= 2)")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--samples", type=int, default=4, help="samples per micro batch")
    p.add_argument("--seq", type=int, default=32, help="tokens per sample")
    p.add_argument("--out", default=None, help="append the records here (JSONL)")
    args = p.parse_args(argv)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad or args.layers < 2 or args.layers % 2:
        print(f"bench/op_census.py: --variants {bad} unknown (choose from {list(VARIANTS)}) "
              "or --layers not even >= 2", file=sys.stderr)
        return 2
    records = [run_variant(v, args.layers, args.experts, args.top_k, args.samples, args.seq)
               for v in names]
    if args.out:
        with open(args.out, "a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    print(tables(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
