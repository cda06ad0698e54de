"""A real slime 0.3.1 command line with the qrl flags, parsed by slime's own parse_args.

slime's parse_args imports sglang, sglang_router, wandb and Megatron-LM's megatron.training.
On the GPU image they are installed; on a CPU machine they live in the overlay site
``tools/slime_cpu_site.sh`` builds, used by a subprocess (``python -m tests.helpers.slime_cli
DIR`` with the site first on PYTHONPATH), never by the test process itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SLIME_MODULES = ("sglang", "sglang_router", "wandb", "megatron.training")
LOSS = "megatron_qrl.integrations.slime.loss.qrl_policy_loss"


def missing_in_process() -> str | None:
    """The first module slime's parse_args needs that this interpreter cannot import."""
    for mod in SLIME_MODULES:
        try:
            if importlib.util.find_spec(mod) is None:
                return mod
        except ModuleNotFoundError:
            return mod
    return None


def cpu_site() -> Path | None:
    """The overlay site tools/slime_cpu_site.sh built ($QRL_SLIME_CPU_SITE, else its cache
    folder), or None when it is not there (built completely: its READY stamp)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    site = Path(os.environ.get("QRL_SLIME_CPU_SITE") or cache / "megatron_qrl" / "slime-cpu-site")
    return site if (site / "READY").is_file() else None


def command_line(workdir: Path) -> list[str]:
    """slime's flags for a tiny random Qwen3-MoE checkpoint written under ``workdir`` (its
    tokenizer and prompts.jsonl too), colocated on one GPU, with our loss and flags."""
    sys.path.insert(0, str(REPO / "tools"))
    from make_random_checkpoint import make_random_checkpoint

    tiny = REPO / "megatron_qrl/data/configs/tiny_qwen3_moe.json"
    ckpt = str(make_random_checkpoint(str(tiny), workdir / "ckpt", layers=1, prompts=16))
    model = ["--num-layers", "1", "--hidden-size", "64", "--ffn-hidden-size", "96",
             "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
             "--kv-channels", "16", "--num-experts", "8", "--moe-router-topk", "2",
             "--moe-ffn-hidden-size", "32", "--vocab-size", "128", "--qk-layernorm",
             "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
             "--untie-embeddings-and-output-weights", "--seq-length", "64",
             "--max-position-embeddings", "64", "--rotary-base", "1000000",
             "--norm-epsilon", "1e-6"]
    return ["--hf-checkpoint", ckpt, "--load", ckpt, "--prompt-data", f"{ckpt}/prompts.jsonl",
            "--input-key", "prompt", "--label-key", "answer", "--custom-rm-path",
            "megatron_qrl.integrations.slime.reward.qrl_math_reward", "--num-rollout", "2",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8",
            "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--colocate",
            "--rollout-num-gpus-per-engine", "1", "--sglang-mem-fraction-static", "0.3",
            "--loss-type", "custom_loss", "--custom-loss-function-path", LOSS,
            "--calculate-per-token-loss", "--qrl-loss-kind", "acr", "--qrl-loss-tis-cap", "3",
            "--qrl-error-tokens-action", "mask", "--qrl-aqn-enabled", *model]


PARSED = ("qrl_loss_kind", "qrl_loss_tis_cap", "qrl_aqn_enabled", "qrl_error_tokens_action",
          "loss_type", "sglang_mem_fraction_static", "colocate", "custom_megatron_init_path",
          "custom_megatron_before_train_step_hook_path", "rollout_data_postprocess_path",
          "num_layers", "num_experts", "layernorm_epsilon")


def parse_command_line(workdir: Path) -> dict:
    """The launcher's ``parse`` (slime's parse_args + add_qrl_args, hooks filled, options
    validated) on :func:`command_line`; the fields the test checks."""
    from megatron_qrl.integrations.slime.launch import parse

    args = parse(command_line(workdir))
    return {k: getattr(args, k) for k in PARSED}


if __name__ == "__main__":
    print("SLIME_CLI " + json.dumps(parse_command_line(Path(sys.argv[1]))))
