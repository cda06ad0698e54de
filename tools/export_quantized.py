#!/usr/bin/env python3
"""Quantize an HF Qwen3 / Qwen3-MoE checkpoint into the format SGLang loads directly.

    python tools/export_quantized.py --hf-dir IN --format fp8_block --out OUT

Formats: see ``python -c "from megatron_qrl.quant import list_specs; print(list_specs())"``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_qrl.models.export import export_quantized  # noqa: E402
from megatron_qrl.quant import list_specs  # noqa: E402
from megatron_qrl.utils.cli import run_tool  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--format", required=True, choices=list_specs(), help="QuantSpec name")
    p.add_argument("--out", required=True, help="output directory (written atomically)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size")
    args = p.parse_args(argv)
    return run_tool("export_quantized", lambda: export_quantized(
        args.hf_dir, args.format, args.out, overwrite=args.overwrite,
        max_shard_bytes=int(args.max_shard_gb * 2**30)))


if __name__ == "__main__":
    sys.exit(main())
