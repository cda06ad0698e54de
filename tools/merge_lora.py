#!/usr/bin/env python
"""Merge the LoRA adapters of a qrl-train run into its base: an HF checkpoint SGLang loads.

    python tools/merge_lora.py --run-dir OUT --out MERGED [--adapter-out ADAPTER] [--overwrite]

Reads the newest driver checkpoint of ``OUT`` (``OUT/checkpoints/step_*.pt``, written after
the RL phase started), rebuilds the run's model from the flags stored in it (single process,
CPU or one GPU), and writes ``W + (alpha/r) B A`` for every adapted projection (LoRA eq. 3,
product in fp32) with the frozen base as the trainer held it (NF4 / rollout-format bases are
dequantized), plus config.json and the tokenizer. ``--adapter-out`` also writes the PEFT
adapter (adapter_model.safetensors + adapter_config.json). Quantize the merged checkpoint for
SGLang with tools/export_quantized.py. Runs with Megatron shape flags after ``--`` are not
reconstructed (only the tiny models and ``--qrl-model checkpoint``). A pipeline-parallel run's
stages are joined into the one-stage model (its TP / EP shards are not: one error). ``--out`` /
``--adapter-out`` must not overlap the run directory; ``--overwrite`` replaces only an earlier
output of this tool.

A run of ``--qrl-model checkpoint`` needs the checkpoint it started from (its config and
tokenizer): ``--base DIR``, else the run's stored ``--qrl-checkpoint``; a relative stored path
is looked for next to the run directory, then in the current directory. The base must have
the run's model shape (the HF config stored in the run's checkpoint).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from megatron_qrl.utils.cli import tool_parser

    p = tool_parser(__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True, help="qrl-train --qrl-output-dir of a LoRA run")
    p.add_argument("--out", required=True, help="merged HF directory (written atomically)")
    p.add_argument("--adapter-out", default=None, help="also write the PEFT adapter here")
    p.add_argument("--base", default=None,
                   help="the checkpoint directory the run started from (default: the run's "
                        "--qrl-checkpoint, a relative one looked for next to --run-dir, then "
                        "in the current directory)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace outputs written earlier by this tool")
    return p.parse_args(argv)


def _arch_diff(cfg: dict, want: dict) -> str | None:
    """None when HF config ``cfg`` describes the run's model ``want``, else the first
    config.json keys that differ."""
    from megatron_qrl.models.hf_config import arch_from_dict

    if arch_from_dict(cfg) == arch_from_dict(want):
        return None
    diff = [f"{k} {cfg.get(k)} (the run's: {want.get(k)})" for k in sorted(set(cfg) | set(want))
            if k != "torch_dtype" and cfg.get(k) != want.get(k)]
    return ", ".join(diff[:3]) or "another shape"


def _base_dir(flags: dict, state: dict, run_dir: Path, base: str | None) -> str | None:
    """The checkpoint directory a ``--qrl-model checkpoint`` run started from, checked
    against the run's stored model config (module docstring); None for the tiny models."""
    from megatron_qrl.config.checkpoint_info import read_checkpoint_info

    if flags.get("qrl_model") != "checkpoint":
        return None
    stored = Path(flags["qrl_checkpoint"])
    if base is not None:
        where, candidates = "--base", [Path(base)]
    else:
        where = f"the run's --qrl-checkpoint {stored}"
        candidates = [stored] if stored.is_absolute() else list(dict.fromkeys(
            [run_dir.resolve().parent / stored, Path.cwd() / stored]))
    for cand in candidates:
        if not cand.is_dir():
            continue
        _, cfg = read_checkpoint_info(cand, flag="--base" if base is not None else where)
        diff = _arch_diff(cfg, state["model_config"]) if state.get("model_config") else None
        if diff is not None:
            raise ValueError(f"{where} ({cand}) holds a model of another shape than the run "
                             f"--run-dir {run_dir}: {diff}; pass --base DIR, the checkpoint "
                             "the run started from")
        return str(cand.resolve())
    raise FileNotFoundError(f"{where} not found (looked at {', '.join(map(str, candidates))}); "
                            "pass --base DIR, the checkpoint the run started from")


def merge_run(run_dir: str | Path, out: str | Path, adapter_out: str | Path | None = None,
              overwrite: bool = False, base: str | None = None) -> Path:
    import torch

    from megatron_qrl.models.hf_io import save_safetensors, write_safetensors
    from megatron_qrl.models.runtime import single_process_megatron
    from megatron_qrl.rl.checkpoint import latest_checkpoint
    from megatron_qrl.rl.driver import prepare_job
    from megatron_qrl.rl.lora_merge import configs_from_flags, merged_lora_tensors
    from megatron_qrl.utils.io import atomic_write_json
    from megatron_qrl.utils.outdir import check_output_dir, safe_output_dir

    check_output_dir(out, [run_dir], tool="merge_lora", overwrite=overwrite)
    if adapter_out is not None:
        check_output_dir(adapter_out, [run_dir, out], tool="merge_lora", overwrite=overwrite,
                         flag="--adapter-out")
    path = latest_checkpoint(run_dir)
    if path is None:
        raise FileNotFoundError(f"--run-dir {run_dir}: no checkpoints/step_*.pt")
    state = torch.load(path, map_location="cpu", weights_only=False)
    flags = dict(state["flags"], qrl_task_prompts=None)  # the prompts play no part in a merge
    if (start := _base_dir(flags, state, Path(run_dir), base)) is not None:
        flags["qrl_checkpoint"] = start
    configs = configs_from_flags(flags)
    lora = configs["lora"]
    if not lora.enabled:
        raise ValueError(f"--run-dir {run_dir}: the run has no adapters (--qrl-lora-rank 0)")
    data = prepare_job(configs)
    with single_process_megatron():
        merged, adapters = merged_lora_tensors(state, configs, data, path)
        with safe_output_dir(out, [run_dir], tool="merge_lora", overwrite=overwrite) as tmp:
            write_safetensors(merged, tmp)
            atomic_write_json(Path(tmp) / "config.json", data.hf_config)
            _save_tokenizer(data.tokenizer, Path(tmp))
        if adapter_out is not None:
            peft = {k: v.contiguous() for k, v in adapters.items()}
            with safe_output_dir(adapter_out, [run_dir, out], tool="merge_lora",
                                 overwrite=overwrite, flag="--adapter-out") as tmp:
                save_safetensors(peft, Path(tmp) / "adapter_model.safetensors")
                atomic_write_json(Path(tmp) / "adapter_config.json", lora.peft_config())
    return Path(out)


def _save_tokenizer(tok, out: Path) -> None:
    if hasattr(tok, "save"):
        tok.save(out)
    elif hasattr(tok, "tok"):
        tok.tok.save_pretrained(str(out))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megatron_qrl.utils.cli import run_tool

    return run_tool("merge_lora", lambda: merge_run(args.run_dir, args.out, args.adapter_out,
                                                    args.overwrite, args.base),
                    debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
