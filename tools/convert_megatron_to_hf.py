#!/usr/bin/env python
"""Convert a Megatron checkpoint written by convert_hf_to_megatron.py back to HF safetensors.

    python tools/convert_megatron_to_hf.py --megatron-dir IN --out OUT

Needs nothing but IN: the HF config and tokenizer files travel inside the checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--megatron-dir", required=True, help="checkpoint from convert_hf_to_megatron.py")
    p.add_argument("--out", required=True, help="output HF directory (must not exist)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megatron_qrl.models.convert import convert_megatron_to_hf
    from megatron_qrl.utils.cli import run_tool

    return run_tool("convert_megatron_to_hf", lambda: convert_megatron_to_hf(
        args.megatron_dir, args.out, show_progress=True))


if __name__ == "__main__":
    sys.exit(main())
