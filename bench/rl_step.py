#!/usr/bin/env python3
"""One full RL step through ``qrl-train``'s own code, split into rollout / recompute / train / sync.

    python bench/rl_step.py --model qwen3_4b --formats bf16,fp8 --out $OUT/rl_step.jsonl
    python bench/rl_step.py --model qwen3_30b_a3b --layers 4 --formats bf16,fp8
    python bench/rl_step.py --device cpu --model tiny      # CPU smoke (reference engine)

Each variant (a rollout ``--formats`` entry, optionally ``FMT@NAME`` with ``--variant-flags
NAME="megatron flags"``) runs ``python -m megatron_qrl.rl.cli`` in a fresh process on a random
checkpoint (``tools/make_random_checkpoint.py``, made once under ``--ckpt-root``) for ``--steps``
RL steps (no SFT) under the model's job preset (``--preset``, default :data:`PRESETS`: the 4B
runs as ``examples/run_qwen3_4b_1gpu.sh`` does, one optimizer update per step; the flags below
override the preset's; the 30B-A3B preset runs the fast MoE path on a GPU with TE —
``--qrl-train-moe-fast-path``: grouped-GEMM experts, alltoall dispatcher, fused permute,
selective recompute of the experts' activation unless ``--megatron`` names a recompute flag;
``--qrl "--no-qrl-train-moe-fast-path"`` measures the sequential experts, ``--moe-experts
stacked`` the stacked experts of ``models.stacked_experts``, also where TE is not installed);
the LAST step's
record (``metrics.jsonl``) is reported: the four phase times (disjoint; a sleeping trainer's
``time_sleep_s`` / ``time_wake_s`` apart, the step ``time_step_s`` covering all), the trainer's peak memory
(``torch.cuda.max_memory_allocated`` of the trainer process; SGLang's memory lives in its own
processes) and

    trainer MFU   = 6 * N_active * trained_tokens / time_train / peak
    recompute MFU = 2 * N_active * recomputed_tokens / time_recompute / peak

(Kaplan et al. 2020, C = 6 N D for a forward + backward; 2 N D forward only), ``peak`` =
989e12 FLOP/s (H200 dense BF16), ``N_active`` the parameters a token passes through (every
weight but the input embedding; of the experts only ``top_k`` of ``num_experts``),
``trained_tokens`` the positions the trainer ran (padding included: what the GPU computed; the
real tokens are ``real_tokens``; ``recomputed_tokens``: those of the pi_prox recompute — none
at one update per step, where the first update's own forward gives pi_prox (the default
``--qrl-prox-from-first-update``; ``--qrl "--no-qrl-prox-from-first-update"`` recomputes every
micro batch). Attention FLOPs are not counted (a lower bound).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._runner import commit  # noqa: E402

PEAK_FLOPS = 989e12
PRESETS = {"qwen3_4b": "qwen3-4b-1gpu", "qwen3_30b_a3b": "qwen3-30b-a3b"}
"""The ``--qrl-preset`` of each model's job (any other model: ``tiny-cpu``, qrl-train's default).
Without it the 4B step would run under ``tiny-cpu``'s two updates per step (half the micro
batches' pi_prox recomputed), not the example's one."""
PHASES = ("time_rollout_s", "time_recompute_s", "time_train_s", "time_sync_s")
SLEEP = ("time_sleep_s", "time_wake_s")


def active_params(cfg: dict) -> int:
    """Parameters a token's forward multiplies with (no input embedding; top-k experts)."""
    from megatron_qrl.models.hf_config import arch_from_dict
    from megatron_qrl.models.mapping import expected_hf_shapes

    arch = arch_from_dict(cfg, source="bench")
    total = 0
    for name, shape in expected_hf_shapes(arch).items():
        n = 1
        for d in shape:
            n *= d
        if name == "model.embed_tokens.weight":
            n = n if arch.tie_word_embeddings else 0  # tied: the output layer's GEMM
        elif ".mlp.experts." in name:
            n = n * arch.moe_top_k / arch.num_experts
        total += n
    return int(total)


def checkpoint(model: str, layers: int | None, root: Path, device: str) -> Path:
    """The random checkpoint of ``model`` (made once, then reused)."""
    sys.path.insert(0, str(ROOT / "tools"))
    from make_random_checkpoint import make_random_checkpoint

    if model == "tiny":
        model = str(ROOT / "megatron_qrl/data/configs/tiny_qwen3.json")
    name = f"{Path(model).stem}-{layers or 'all'}L"
    out = root / name
    if not (out / "config.json").is_file():
        make_random_checkpoint(model, out, layers=layers, device=device)
    return out


def _job(args: argparse.Namespace, ckpt: Path, fmt: str, flags: str, out_dir: Path) -> list[str]:
    preset = args.preset or PRESETS.get(args.model, "tiny-cpu")
    qrl = ["--qrl-preset", preset, "--qrl-model", "checkpoint", "--qrl-checkpoint", str(ckpt),
           "--qrl-rollout-format", fmt, "--qrl-sft-steps", "0", "--qrl-steps", str(args.steps),
           "--qrl-prompts-per-step", str(args.prompts), "--qrl-rollout-n-samples-per-prompt",
           str(args.n), "--qrl-rollout-max-new-tokens", str(args.max_new_tokens),
           "--qrl-micro-batch-size", str(args.micro_batch_size), "--qrl-loss-kind", "tis",
           "--qrl-train-forward", args.train_forward,
           *(["--qrl-train-moe-experts", args.moe_experts] if args.moe_experts else []),
           "--qrl-routing-replay", "off", "--qrl-output-dir", str(out_dir), "--qrl-no-progress",
           "--no-qrl-tensorboard", "--qrl-save-interval", "-1"]
    if args.max_tokens_per_micro_batch:
        qrl += ["--qrl-max-tokens-per-micro-batch", str(args.max_tokens_per_micro_batch)]
    if args.profile:  # the last RL step (no SFT: steps 0 .. steps - 1)
        qrl += ["--qrl-profile-step", str(args.steps - 1)]
    if args.device == "cpu":
        qrl += ["--qrl-rollout-engine", "reference"]
    else:
        qrl += ["--qrl-rollout-engine", "sglang", "--qrl-rollout-sglang-mem-fraction",
                str(args.mem_fraction)]
    qrl_variant, megatron_variant = split_variant_flags(flags)
    qrl += shlex.split(args.qrl) + qrl_variant
    megatron = (["--bf16"] if args.device != "cpu" else []) + shlex.split(args.megatron) \
        + megatron_variant
    return [sys.executable, "-m", "megatron_qrl.rl.cli", *qrl, "--", *megatron]


def split_variant_flags(flags: str) -> tuple[list[str], list[str]]:
    """``(qrl flags, megatron flags)`` of a ``--variant-flags`` value: a ``--qrl-*`` flag and
    the values after it (up to the next ``--`` flag) go to qrl-train, the rest after ``--``."""
    qrl: list[str] = []
    megatron: list[str] = []
    dest = megatron
    for tok in shlex.split(flags):
        if tok.startswith("--"):
            dest = qrl if tok.startswith("--qrl-") or tok.startswith("--no-qrl-") else megatron
        dest.append(tok)
    return qrl, megatron


def run_variant(args: argparse.Namespace, ckpt: Path, cfg: dict, variant: str,
                flags: str) -> dict:
    """Run one qrl-train job; its last RL step's phases, MFU and peak memory."""
    fmt = variant.split("@")[0]
    out_dir = Path(tempfile.mkdtemp(prefix=f"rl_step_{variant.replace('@', '_')}_"))
    cmd = _job(args, ckpt, fmt, flags, out_dir)
    t = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                              p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)))
    res: dict = {"variant": variant, "format": fmt, "flags": flags, "qrl_flags": args.qrl,
                 "moe_experts": args.moe_experts,
                 "preset": cmd[cmd.index("--qrl-preset") + 1],
                 "micro_batch_size": args.micro_batch_size,
                 "max_tokens_per_micro_batch": args.max_tokens_per_micro_batch,
                 "wall_s": round(time.time() - t, 1)}
    metrics = out_dir / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.is_file():
        res["error"] = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        sys.stderr.write(proc.stdout[-1500:] + proc.stderr[-4000:])
        return res
    rec = [json.loads(x) for x in metrics.read_text().splitlines()][-1]
    said = re.search(r"SGLang attention backend: (\S+)", proc.stdout)  # the engine's choice
    res["attention_backend"] = said.group(1) if said else None
    n = active_params(cfg)
    tokens = rec.get("trained_tokens") or 0
    res.update({k: round(rec[k], 3) for k in PHASES})
    # the trainer's sleep / wake (--qrl-trainer-sleep) lie outside the four phases
    res.update({k: round(rec[k], 3) for k in SLEEP if k in rec})
    step = rec.get("time_step_s") or sum(rec[k] for k in (*PHASES, *SLEEP) if k in rec)
    res.update(
        step_s=round(step, 3), active_params=n, trained_tokens=tokens,
        real_tokens=int(args.prompts * args.n * (rec.get("response_len") or 0)),
        train_recompute_share=round((rec["time_train_s"] + rec["time_recompute_s"]) / step, 3),
        trainer_mfu=round(6 * n * tokens / rec["time_train_s"] / PEAK_FLOPS, 4),
        recompute_mfu=round(2 * n * rec.get("recomputed_tokens", tokens)
                            / max(rec["time_recompute_s"], 1e-9) / PEAK_FLOPS, 4),
        trainer_peak_gib=rec.get("trainer_peak_gib"),
        trainer_reserved_gib=rec.get("trainer_reserved_gib"),
        alloc_retries=rec.get("alloc_retries"), response_len=rec.get("response_len"),
        # the engine's memory release (in the rollout) / resume (in the sync), its KV pool and
        # the waves its samples decoded in (rollout.capacity)
        **{k: rec.get(k) for k in ("time_engine_release_s", "time_engine_resume_s",
                                   "engine_kv_pool_tokens", "engine_max_running_requests",
                                   "rollout_waves")},
        reward_mean=rec.get("reward_mean"), mismatch_kl=rec.get("mismatch_kl"))
    if rec.get("profile_summary"):  # --profile: the trainer phases' profile of that step
        res["profile"] = json.loads(Path(rec["profile_summary"]).read_text())
        res.update({k: rec[k] for k in rec if k.startswith("profile_") and k != "profile_summary"})
    return res


def markdown_table(cols: tuple[str, ...], cells: list[list[str]]) -> str:
    """A markdown table: the header ``cols``, then one line per row of ``cells``."""
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                     + ["| " + " | ".join(c) + " |" for c in cells])


def _table(rows: list[dict]) -> str:
    cols = ("variant", "time_rollout_s", "time_recompute_s", "time_train_s", "time_sync_s",
            "train_recompute_share", "trainer_mfu", "recompute_mfu", "trainer_peak_gib",
            "trained_tokens")
    return markdown_table(cols, [
        [r["variant"], f"error: {r['error']}"] if "error" in r else [str(r.get(c, "")) for c in cols]
        for r in rows])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3_4b", help="qwen3_4b | qwen3_30b_a3b | tiny | FILE")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: all)")
    p.add_argument("--formats", default="bf16,fp8", help="rollout formats (FMT or FMT@FLAGSNAME)")
    p.add_argument("--variant-flags", action="append", default=[],
                   help='NAME="flags" for variants FMT@NAME (repeatable): --qrl-* flags (and '
                        'their values) go to qrl-train, the others to Megatron')
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--steps", type=int, default=2, help="RL steps per job; the last is reported")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--max-tokens-per-micro-batch", type=int, default=0)
    p.add_argument("--train-forward", default="bf16", choices=("bf16", "aligned"),
                   help="--qrl-train-forward of every variant (aligned: quantized formats only)")
    p.add_argument("--moe-experts", default=None, choices=("megatron", "stacked"),
                   help="--qrl-train-moe-experts of every variant (default: the preset's; "
                   "stacked: one grouped GEMM per expert linear, no Transformer Engine needed)")
    p.add_argument("--profile", action="store_true",
                   help="profile the last RL step's trainer phases (--qrl-profile-step): GPU "
                        "kernel time vs wall, top kernels and host ops, host syncs, cudaMalloc "
                        "/ cudaFree; the summary goes into the record as 'profile'")
    p.add_argument("--mem-fraction", type=float, default=0.3, help="SGLang mem_fraction_static")
    p.add_argument("--megatron", default="", help="Megatron flags for every variant")
    p.add_argument("--preset", default=None, help="qrl-train --qrl-preset of every variant "
                   "(default: the model's job preset, PRESETS; tiny-cpu otherwise)")
    p.add_argument("--qrl", default="", help="extra --qrl-* flags for every variant")
    p.add_argument("--ckpt-root", default="/tmp/qrl_random_ckpt")
    p.add_argument("--out", default=None, help="append the records here (JSONL)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu" and args.model != "tiny":
        print("bench/rl_step.py: --device cpu runs --model tiny only", file=sys.stderr)
        return 2
    named = dict(v.split("=", 1) for v in args.variant_flags)
    ckpt = checkpoint(args.model, args.layers, Path(args.ckpt_root), args.device)
    cfg = json.loads((ckpt / "config.json").read_text())
    rows = []
    for variant in [v.strip() for v in args.formats.split(",") if v.strip()]:
        name = variant.partition("@")[2]
        if name and name not in named:
            print(f"bench/rl_step.py: variant {variant}: no --variant-flags {name}=...",
                  file=sys.stderr)
            return 2
        res = run_variant(args, ckpt, cfg, variant, named.get(name, ""))
        res.update(model=args.model, layers=cfg["num_hidden_layers"], device=args.device,
                   commit=commit())
        print("[rl_step] " + json.dumps(res), flush=True)
        rows.append(res)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(res) + "\n")
    print(_table(rows))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
