#!/usr/bin/env python
"""Convert a Megatron checkpoint written by convert_hf_to_megatron.py back to HF safetensors.

    python tools/convert_megatron_to_hf.py --megatron-dir IN --out OUT [--overwrite]

Needs nothing but IN: the HF config and tokenizer files travel inside the checkpoint.
OUT must not overlap IN; --overwrite replaces only an earlier output of this tool; a
non-finite weight is refused by name. ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout


from megatron_qrl.utils.cli import run_tool, tool_parser  # noqa: E402


def parse_args(argv: list[str] | None = None):
    p = tool_parser(__doc__)
    p.add_argument("--megatron-dir", required=True, help="checkpoint from convert_hf_to_megatron.py")
    p.add_argument("--out", required=True, help="output HF directory (new, or see --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out written earlier by this tool")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megatron_qrl.models.convert import convert_megatron_to_hf

    return run_tool("convert_megatron_to_hf", lambda: convert_megatron_to_hf(
        args.megatron_dir, args.out, show_progress=True, overwrite=args.overwrite),
        debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
