#!/usr/bin/env python3
"""One train micro batch of the RL step (bench/rl_step.py -> qrl-train) against one of
bench/train_mfu.py, op by op, on the CPU.

    python bench/path_census.py                     # tiny Qwen3-MoE (4 layers, 16 experts)
    python bench/path_census.py --micro-batch-size 2 --out c.jsonl

1. Runs ``qrl-train`` in this process exactly as bench/rl_step.py starts it (its ``_job``
   flags: the qwen3-30b-a3b preset, the reference engine, one RL step of 4 updates, no
   replay, BF16 forward) on a random checkpoint of bench/op_census.py's tiny MoE, and keeps the
   arguments of every ``PolicyTrainer.train_step`` call of that step (the micro batches as the
   step built them, the loss function, ``routing``).
2. On that trainer, under :class:`megatron_qrl.utils.op_census.OpCensus`, one micro batch of
   each kind through ``PolicyTrainer._run`` (forward + backward + loss):
   ``rl first update`` (pi_prox from this forward, the routing agreement measured),
   ``rl later update`` (pi_prox recomputed before), ``train_mfu`` (bench/train_mfu.py's
   synthetic batch, its loss function and flags), and each path's whole ``train_step`` of
   one update (the step's host work: guard, optimizer, metrics).
3. Prints the ops per phase, the aten ops whose counts differ between the RL micro batches and
   train_mfu's, the host syncs, the micro batches' keys and shapes, and the config fields that
   differ between the two paths' flags.

CPU counts, not GPU times: an op's cost on the GPU depends on its size (the loss-side ops run
over [tokens, vocab]).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def rl_job(args: argparse.Namespace, cfg: dict, work: Path, measure) -> tuple[dict, list[str]]:
    """Run a qrl-train job as bench/rl_step.py starts it (one RL step); at the step's last
    ``train_step`` call, before it runs, ``measure(calls)`` inside the live job, where
    ``calls``: ``(trainer, micro batches, loss_fn, per_token_loss, routing)`` of each call of
    the step. Returns ``(measure's result, the job's argv)``."""
    import rl_step

    from megatron_qrl.rl import trainer as trainer_mod
    from megatron_qrl.rl.cli import main, parse_configs

    cfg_path = work / "tiny_moe.json"
    cfg_path.write_text(json.dumps(cfg))
    ckpt = rl_step.checkpoint(str(cfg_path), None, work / "ckpt", "cpu")
    job = SimpleNamespace(
        preset=None, model="qwen3_30b_a3b", steps=1, prompts=args.prompts, n=args.n,
        max_new_tokens=args.new_tokens, micro_batch_size=args.micro_batch_size,
        train_forward="bf16", moe_experts=None, max_tokens_per_micro_batch=0, device="cpu",
        qrl="", megatron="", mem_fraction=0.5, profile=False)
    cmd = rl_step._job(job, ckpt, "fp8", "", work / "run")
    argv = cmd[cmd.index("megatron_qrl.rl.cli") + 1:]
    updates = parse_configs(argv)[0].run.updates_per_step
    calls: list[tuple] = []
    out: dict = {}
    real = trainer_mod.PolicyTrainer.train_step

    def spy(self, microbatches, loss_fn, per_token_loss=None, routing=False):
        calls.append((self, [dict(mb) for mb in microbatches], loss_fn, per_token_loss, routing))
        if len(calls) == updates:
            out.update(measure(calls))
        return real(self, microbatches, loss_fn, per_token_loss, routing)

    with mock.patch.object(trainer_mod.PolicyTrainer, "train_step", spy):
        code = main(argv)
    if code or not out:
        raise SystemExit(f"bench/path_census.py: qrl-train exited {code} ({len(calls)} updates)")
    return out, argv


def mfu_side(args: argparse.Namespace, cfg: dict):
    """``(micro batches of one update, loss_fn, configs)`` of bench/train_mfu.py (its plain
    row words, flags and synthetic rollout batch) at this micro batch size."""
    import train_mfu

    from megatron_qrl.losses.megatron_adapter import PolicyLossFunc
    from megatron_qrl.rl.cli import parse_configs

    configs = parse_configs([*train_mfu.BASE_FLAGS, *train_mfu.PLAIN_FLAGS,
                             "--qrl-train-moe-experts", "stacked"])[0]
    ns = SimpleNamespace(prompts=args.prompts, n=args.n, new_tokens=args.new_tokens,
                         prompt_len=args.prompt_len, full_frac=1.0)
    batch = train_mfu.rollout_batch(ns, cfg["vocab_size"])
    row = train_mfu.Row.parse(f"none-mb{args.micro_batch_size}-st")
    groups = train_mfu.micro_batches(row, batch, 4)
    for mb in groups[0]:  # train_mfu's rows run one update: pi_prox from this forward
        mb["old_log_probs"] = None
    loss_fn = PolicyLossFunc(configs["loss"], configs["error_tokens"],
                             temperature=configs["rollout"].temperature, chunked=row.chunked)
    return groups[0], loss_fn, configs


def config_diff(a, b, prefix: str = "") -> list[tuple[str, object, object]]:
    """``(field, a's, b's)`` of the dataclass fields that differ (nested)."""
    out = []
    for f in dataclasses.fields(a):
        va, vb = getattr(a, f.name), getattr(b, f.name, None)
        if dataclasses.is_dataclass(va) and dataclasses.is_dataclass(vb):
            out += config_diff(va, vb, f"{prefix}{f.name}.")
        elif va != vb:
            out.append((f"{prefix}{f.name}", va, vb))
    return out


def fresh(mb: dict) -> dict:
    """A copy of ``mb`` with its own tensors (the census marks a micro batch's tensors as on
    the device when ``forward_step`` takes them; a later phase must start from host tensors)."""
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in mb.items()}


def shapes(mb: dict) -> dict[str, object]:
    return {k: (list(v.shape) if torch.is_tensor(v) else v) for k, v in sorted(mb.items())}


def census(calls: list[tuple], mfu: tuple) -> dict:
    """The phases of the module docstring, counted on the RL job's trainer."""
    from op_census import _DeviceBatches, _mark_trainer

    from megatron_qrl.utils.op_census import OpCensus

    updates = len(calls)  # (the train_step calls below go through the spy too)
    trainer, first_mbs, rl_loss, _, routing = calls[0]
    _, later_mbs, _, _, _ = calls[-1]
    mfu_mbs, mfu_loss, _ = mfu
    c = OpCensus()
    rec: dict = {}
    _mark_trainer(c, trainer)

    def run(name, mbs, loss, sink=None):
        one = _DeviceBatches([fresh(mbs[0])], c)
        with c.phase(name):
            trainer._run(one, loss, False, sink)
            if sink is not None:
                trainer._routing_totals(sink)

    run("warm-up (train_mfu, not compared)", mfu_mbs, mfu_loss)  # lazy state of this shape
    run("rl first update", first_mbs, rl_loss, [] if routing else None)
    run("rl later update", later_mbs, rl_loss)
    run("train_mfu", mfu_mbs, mfu_loss)
    rl_group = _DeviceBatches([fresh(m) for m in later_mbs], c)
    mfu_group = _DeviceBatches([fresh(m) for m in mfu_mbs], c)
    with c.phase("rl train_step (one update)"):
        trainer.train_step(rl_group, rl_loss)
    guard, trainer.guard = trainer.guard, None  # train_mfu's trainer has no step guard
    try:
        with c.phase("train_mfu train_step (one update)"):
            trainer.train_step(mfu_group, mfu_loss, per_token_loss=False)
    finally:
        trainer.guard = guard
    n_rl, n_mfu = len(later_mbs), len(mfu_mbs)
    for p, counts in c.phases.items():
        rec[p] = {"ops": sum(counts.ops.values()),
                  "syncs": [f"{s.what} @ {s.frame}" for s in counts.syncs],
                  "h2d": len(counts.h2d)}
    rec["micro_batches_per_update"] = {"rl": n_rl, "train_mfu": n_mfu}
    diff = {}
    for name in ("rl first update", "rl later update"):
        a, b = c.phases[name].ops, c.phases["train_mfu"].ops
        diff[name] = {k: (a[k], b[k]) for k in sorted(set(a) | set(b)) if a[k] != b[k]}
    a, b = c.phases["rl train_step (one update)"], c.phases["train_mfu train_step (one update)"]
    diff["train_step"] = {k: (a.ops[k], b.ops[k]) for k in sorted(set(a.ops) | set(b.ops))
                          if a.ops[k] != b.ops[k]}
    syncs_a = Counter(f"{s.what} @ {s.frame}" for s in a.syncs)
    syncs_b = Counter(f"{s.what} @ {s.frame}" for s in b.syncs)
    rec["train_step_syncs_only_rl"] = dict(syncs_a - syncs_b)
    rec["train_step_syncs_only_train_mfu"] = dict(syncs_b - syncs_a)
    rec["op_diff_vs_train_mfu"] = diff
    rec["rl_micro_batch"] = shapes(later_mbs[0])
    rec["rl_first_micro_batch_old_log_probs"] = first_mbs[0].get("old_log_probs") is None
    rec["train_mfu_micro_batch"] = shapes(mfu_mbs[0])
    rec["routing_first_update"] = routing
    rec["updates"] = updates
    return rec


def main(argv: list[str] | None = None) -> int:
    import op_census

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--prompt-len", type=int, default=8, help="train_mfu's prompt length")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--out", default=None, help="write the record here (JSON)")
    args = p.parse_args(argv)
    cfg = op_census.model_config(args.layers, args.experts, args.top_k)
    with tempfile.TemporaryDirectory(prefix="path_census_") as tmp:
        mfu = mfu_side(args, cfg)
        rec, rl_argv = rl_job(args, cfg, Path(tmp), lambda calls: census(calls, mfu))
        from megatron_qrl.rl.cli import parse_configs

        rl_configs = parse_configs(rl_argv)[0]
    rec["config_diff (rl, train_mfu)"] = [
        (k, repr(a), repr(b)) for k, a, b in config_diff(rl_configs, mfu[2])
        if not k.startswith(("run.output_dir", "run.checkpoint", "model."))]
    text = json.dumps(rec, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    print("ops per phase:", Counter({k: v["ops"] for k, v in rec.items()
                                     if isinstance(v, dict) and "ops" in v}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
