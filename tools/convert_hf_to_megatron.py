#!/usr/bin/env python
"""Convert an HF Qwen3 / Qwen3-MoE safetensors directory to a Megatron dist checkpoint.

    python tools/convert_hf_to_megatron.py --hf-dir IN --out OUT [--uaq-scale S] [--overwrite]
    python tools/convert_hf_to_megatron.py --hf-dir IN --dry-run

The checkpoint carries the HF config and tokenizer files (OUT/hf) and loads at any TP/EP.
OUT must not overlap IN; --overwrite replaces only an earlier output of this tool. IN must be
full precision (not a quantized export) and finite. ``--debug`` shows tracebacks.
``--dry-run`` builds the model on the meta device and prints total / active parameters
(``--hf-dir`` may then be a config.json file).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout


from megatron_qrl.utils.cli import positive_float, run_tool, tool_parser  # noqa: E402


def parse_args(argv: list[str] | None = None):
    p = tool_parser(__doc__)
    p.add_argument("--hf-dir", required=True, help="HF model directory (config.json + *.safetensors)")
    p.add_argument("--out", help="output checkpoint directory (new, or see --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out written earlier by this tool")
    p.add_argument("--uaq-scale", type=positive_float, default=None,
                   help="fold QuRL UAQ scale s into the weights (norms x s, consumers / s)")
    p.add_argument("--dry-run", action="store_true",
                   help="build the model on the meta device, print parameter counts, write nothing")
    args = p.parse_args(argv)
    if not args.dry_run and not args.out:
        p.error("--out is required unless --dry-run is given")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megatron_qrl.models.convert import convert_hf_to_megatron, dry_run

    def work():
        if not args.dry_run:
            return convert_hf_to_megatron(args.hf_dir, args.out, args.uaq_scale, show_progress=True,
                                          overwrite=args.overwrite)
        counts = dry_run(args.hf_dir)
        print(f"total parameters:  {counts['total']:,} ({counts['total'] / 1e9:.2f}B)")
        print(f"active parameters: {counts['active']:,} ({counts['active'] / 1e9:.2f}B)")
        return None

    return run_tool("convert_hf_to_megatron", work, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
