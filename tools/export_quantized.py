#!/usr/bin/env python3
"""Quantize an HF Qwen3 / Qwen3-MoE checkpoint into the format SGLang loads directly.

    python tools/export_quantized.py --hf-dir IN --format fp8_block --out OUT [--overwrite]

Formats: see ``python -c "from megatron_qrl.quant import list_specs; print(list_specs())"``.
OUT must not overlap IN; --overwrite replaces only an earlier output of this tool. IN must be
the full-precision checkpoint (not a quantized export). ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_qrl.models.export import export_quantized  # noqa: E402
from megatron_qrl.quant import list_specs  # noqa: E402
from megatron_qrl.utils.cli import positive_float, run_tool, tool_parser  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = tool_parser(__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--format", required=True, choices=list_specs(), help="QuantSpec name")
    p.add_argument("--out", required=True, help="output directory (written atomically)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out written earlier by this tool")
    p.add_argument("--max-shard-gb", type=positive_float, default=5.0,
                   help="safetensors shard size (GiB, > 0)")
    args = p.parse_args(argv)
    return run_tool("export_quantized", lambda: export_quantized(
        args.hf_dir, args.format, args.out, overwrite=args.overwrite,
        max_shard_bytes=max(1, int(args.max_shard_gb * 2**30))), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
