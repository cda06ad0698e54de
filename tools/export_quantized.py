#!/usr/bin/env python3
"""Quantize an HF Qwen3 / Qwen3-MoE checkpoint into the format SGLang loads directly.

    python tools/export_quantized.py --hf-dir IN --format fp8_block --out OUT [--overwrite]
    python tools/export_quantized.py --hf-dir IN --format w4a16 --calibrate awq --out OUT \\
        [--calib prompts.jsonl] [--calib-samples 64]

Formats: see ``python -c "from megatron_qrl.quant import list_specs; print(list_specs())"``.
OUT must not overlap IN; --overwrite replaces only an earlier output of this tool. IN must be
the full-precision checkpoint (not a quantized export). ``--debug`` shows tracebacks.
``--calibrate`` (megatron_qrl/models/calibrate.py): ``none`` (round-to-nearest), ``awq``
(with --format w4a16) or ``smoothquant`` (with --format int8), calibrated by ModelOpt on
prompts (``--calib``: a ``{"prompt", "answer"}`` jsonl; default: the synthetic addition task)
tokenized with IN's tokenizer; the output has the same layout as ``--calibrate none``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_qrl.models.calibrate import METHODS, check_method  # noqa: E402
from megatron_qrl.models.export import export_quantized  # noqa: E402
from megatron_qrl.quant import list_specs  # noqa: E402
from megatron_qrl.utils.cli import positive_float, positive_int, run_tool, tool_parser  # noqa: E402


def calibration_ids(hf_dir: str, calib: str | None, samples: int) -> list[list[int]]:
    """The first ``samples`` prompts of ``calib`` (or of the synthetic addition task, seed 0),
    each ``[bos] + tokens`` as the rollout sends them."""
    from megatron_qrl.data import addition_problems, load_prompt_jsonl
    from megatron_qrl.rl.start_model import load_tokenizer

    tok = load_tokenizer(hf_dir)
    prompts = ([r.prompt for r in load_prompt_jsonl(calib, flag="--calib")] if calib else
               [p["prompt"] for p in addition_problems(samples, seed=0)])
    bos = [] if tok.bos_id is None else [tok.bos_id]
    return [[*bos, *tok.encode(p)] for p in prompts[:samples]]


def _run(args) -> Path:
    check_method(args.calibrate, args.format)
    calib = (calibration_ids(args.hf_dir, args.calib, args.calib_samples)
             if args.calibrate != "none" else ())
    return export_quantized(args.hf_dir, args.format, args.out, overwrite=args.overwrite,
                            max_shard_bytes=max(1, int(args.max_shard_gb * 2**30)),
                            calibrate=args.calibrate, calib=calib)


def main(argv: list[str] | None = None) -> int:
    p = tool_parser(__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--format", required=True, choices=list_specs(), help="QuantSpec name")
    p.add_argument("--out", required=True, help="output directory (written atomically)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out written earlier by this tool")
    p.add_argument("--max-shard-gb", type=positive_float, default=5.0,
                   help="safetensors shard size (GiB, > 0)")
    p.add_argument("--calibrate", choices=METHODS, default="none",
                   help="none: round-to-nearest; awq: --format w4a16; smoothquant: --format int8")
    p.add_argument("--calib", default=None, metavar="JSONL",
                   help="calibration prompts ({\"prompt\", \"answer\"} per line); default: the "
                        "synthetic addition task")
    p.add_argument("--calib-samples", type=positive_int, default=64,
                   help="number of calibration prompts (the first N)")
    args = p.parse_args(argv)
    return run_tool("export_quantized", lambda: _run(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
