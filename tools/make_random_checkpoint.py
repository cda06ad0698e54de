#!/usr/bin/env python
"""Write a randomly initialised HF checkpoint (safetensors + config.json + the char tokenizer
+ the synthetic addition prompts).

    python tools/make_random_checkpoint.py --config qwen3_4b --out /tmp/qwen3-4b-random
    python tools/make_random_checkpoint.py --config qwen3_30b_a3b --layers 8 --out DIR
    python tools/make_random_checkpoint.py --config my/config.json --layers 2 --out DIR

The smoke-test checkpoint every example and bench can use without a hub: ``--qrl-model
checkpoint --qrl-checkpoint DIR`` reads it (the char tokenizer's ids are a prefix of the
model's vocabulary). ``--config``: ``qwen3_4b`` / ``qwen3_30b_a3b`` (megatron_qrl/data/configs)
or an HF ``config.json``; ``--layers N`` keeps the first N decoder layers' shape. Linear and
embedding weights ~ N(0, initializer_range), norm gains 1 + N(0, 0.02); each tensor is drawn
from its own generator (seed + name), on the GPU when there is one, and streamed into
safetensors shards, so at most one shard (``--shard-gb``) is held in host memory. The
directory appears atomically (``utils.outdir.safe_output_dir``: built under a temporary name,
marked as this tool's output, renamed; ``--overwrite`` replaces only an earlier output).

Beside the weights: the character tokenizer (``CharTokenizer.save``: our file and an HF
``tokenizer.json`` + ``tokenizer_config.json``, so ``AutoTokenizer.from_pretrained(DIR)`` — what
slime and SGLang load from ``--hf-checkpoint`` — gives the same ids) and ``--prompts N``
synthetic addition problems (seeded by ``--seed``) as :data:`PROMPTS_FILE`, one
``{"prompt": "12+34=", "answer": "46"}`` per line: ``qrl-train --qrl-task-prompts`` reads it,
and so does slime (``--prompt-data DIR/prompts.jsonl --input-key prompt --label-key answer``
with ``--custom-rm-path megatron_qrl.integrations.slime.reward.qrl_math_reward``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch  # noqa: E402

BUILTIN = ("qwen3_4b", "qwen3_30b_a3b")
PROMPTS_FILE = "prompts.jsonl"
"""The addition prompts written beside the weights (see the module docstring)."""


def load_config(name: str, layers: int | None) -> dict:
    """The HF config of ``name`` (built-in or a file) with ``layers`` decoder layers."""
    if name in BUILTIN:
        path = Path(__file__).resolve().parents[1] / "megatron_qrl/data/configs" / f"{name}.json"
    else:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"--config {name}: neither {' / '.join(BUILTIN)} nor a "
                                    "config.json file")
    cfg = json.loads(path.read_text())
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be >= 1, got {layers}")
        cfg["num_hidden_layers"] = layers
        cfg["max_window_layers"] = min(int(cfg.get("max_window_layers", layers)), layers)
    cfg["torch_dtype"] = "bfloat16"
    return cfg


def random_tensors(cfg: dict, seed: int, device: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, bf16 CPU tensor)`` of every weight of ``cfg``'s model, one at a time."""
    from megatron_qrl.models.hf_config import arch_from_dict
    from megatron_qrl.models.mapping import expected_hf_shapes

    std = float(cfg.get("initializer_range", 0.02))
    for name, shape in expected_hf_shapes(arch_from_dict(cfg, source="--config")).items():
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        t = 1.0 + 0.02 * t if name.endswith("norm.weight") else std * t
        yield name, t.to(torch.bfloat16).cpu()


def make_random_checkpoint(config: str, out: str | Path, layers: int | None = None,
                           seed: int = 0, shard_gb: float = 2.0, device: str | None = None,
                           overwrite: bool = False, prompts: int = 512) -> Path:
    """Write the checkpoint directory ``out`` (with ``prompts`` addition problems); returns it."""
    from megatron_qrl.data import CharTokenizer
    from megatron_qrl.data.synthetic import addition_problems, write_jsonl
    from megatron_qrl.models.hf_config import arch_from_dict
    from megatron_qrl.models.hf_io import write_safetensors
    from megatron_qrl.models.mapping import expected_hf_shapes
    from megatron_qrl.utils.io import atomic_write_json
    from megatron_qrl.utils.outdir import safe_output_dir

    cfg = load_config(config, layers)
    from megatron_qrl.data.synthetic import count_addition_problems

    if not 1 <= prompts <= count_addition_problems(1, 3):
        raise ValueError(f"--prompts must be in [1, {count_addition_problems(1, 3)}] (distinct "
                         f"1-3 digit addition problems), got {prompts}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    inputs = [] if config in BUILTIN else [config]
    need = 2 * sum(math.prod(s) for s in expected_hf_shapes(arch_from_dict(cfg, "--config")).values())
    tokenizer = CharTokenizer()  # the checkpoint's tokenizer: the config names its ids
    cfg = {**cfg, "bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    with safe_output_dir(out, inputs, tool="make_random_checkpoint", overwrite=overwrite,
                         need_bytes=need) as tmp:
        atomic_write_json(tmp / "config.json", cfg)
        atomic_write_json(tmp / "generation_config.json", {
            "bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id"),
            "do_sample": True})
        write_safetensors(random_tensors(cfg, seed, device), tmp,
                          max_shard_bytes=int(shard_gb * 2**30))
        tokenizer.save(tmp, hf=True)
        write_jsonl(tmp / PROMPTS_FILE, addition_problems(prompts, seed))
    return Path(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from megatron_qrl.utils.cli import positive_float, positive_int, tool_parser

    p = tool_parser(__doc__)
    p.add_argument("--config", required=True, help=f"{' | '.join(BUILTIN)} | path/config.json")
    p.add_argument("--out", required=True, help="output directory (new, or see --overwrite)")
    p.add_argument("--layers", type=positive_int, default=None,
                   help="decoder layers (default: the config's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", type=positive_int, default=512,
                   help=f"addition problems written as {PROMPTS_FILE} (1-3 digit operands)")
    p.add_argument("--shard-gb", type=positive_float, default=2.0,
                   help="safetensors shard size (GiB)")
    p.add_argument("--device", default=None, help="where to draw (default: cuda if present)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out written earlier by this tool")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megatron_qrl.utils.cli import run_tool

    return run_tool("make_random_checkpoint", lambda: make_random_checkpoint(
        args.config, args.out, args.layers, args.seed, args.shard_gb, args.device,
        args.overwrite, args.prompts), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
