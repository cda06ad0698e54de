#!/usr/bin/env python3
"""Which layer types cause the train/rollout mismatch? KL(pi_aligned || pi_bf16) per layer type.

    python tools/mismatch_report.py --hf-dir DIR --format int8 --out report.png
    python tools/mismatch_report.py --hf-dir DIR --format fp8 --kv-cache fp8_e4m3 --out r.png

Runs the Megatron trainer forward of the HF model in DIR with the rollout-aligned
quantization enabled in one layer type at a time (attention, dense mlp or experts) and in
all of them, prints the token-mean / max KL against the BF16 forward (and, for MoE, how
often the top-k routing still agrees with BF16), and writes a bar chart. ``--kv-cache FMT``
(a rounding KV-cache format) adds a "kv cache" row: BF16 weights, K/V rounded as the engine's
cache stores them, every position read as a decode step reads it; "all" then includes it. Prompts are random
token ids unless --prompts names a text/JSONL file (then DIR needs a tokenizer). DIR must be
the full-precision checkpoint: a quantized export (tools/export_quantized.py) is refused, its
codes are not weights. ``--seq-len`` is at most the model's ``max_position_embeddings``; an
existing ``--out`` is replaced only with ``--overwrite``. ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_qrl.quant import list_specs  # noqa: E402
from megatron_qrl.quant.kv_cache import list_kv_formats  # noqa: E402
from megatron_qrl.utils.cli import positive_int, run_tool, tool_parser  # noqa: E402


def _report(args) -> Path:
    from megatron_qrl.models.hf_io import open_hf_checkpoint
    from megatron_qrl.te_quant.attribution import format_table, plot_rows, prompt_ids, run_report
    from megatron_qrl.utils.outdir import check_output_file

    out = check_output_file(args.out, [args.hf_dir, args.prompts], overwrite=args.overwrite)
    _, arch, _ = open_hf_checkpoint(args.hf_dir)  # refuses a quantized export by name
    if args.seq_len > arch.max_position_embeddings:
        raise ValueError(f"--seq-len {args.seq_len} is longer than the model's "
                         f"max_position_embeddings {arch.max_position_embeddings} "
                         f"({args.hf_dir}/config.json); give --seq-len <= "
                         f"{arch.max_position_embeddings}")
    if args.prompts is not None and not Path(args.prompts).is_file():
        raise FileNotFoundError(f"--prompts {args.prompts}: file not found")
    ids = prompt_ids(args.hf_dir, args.prompts, args.batch, args.seq_len, arch.vocab_size,
                     args.seed)
    _, rows = run_report(args.hf_dir, args.format, ids, args.kv_cache)
    label = args.format if args.kv_cache == "bf16" else f"{args.format}, kv cache={args.kv_cache}"
    print(format_table(rows, label))
    out.parent.mkdir(parents=True, exist_ok=True)
    plot_rows(rows, label, str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    p = tool_parser(__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", required=True, help="HF Qwen3 / Qwen3-MoE directory (full precision)")
    p.add_argument("--format", required=True, choices=[f for f in list_specs() if f != "bf16"],
                   help="rollout QuantSpec name")
    p.add_argument("--kv-cache", choices=list_kv_formats(), default="bf16",
                   help="rollout KV-cache format (--qrl-rollout-kv-cache); a rounding one adds "
                        "the 'kv cache' row")
    p.add_argument("--out", required=True, help="PNG bar chart to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--prompts", default=None, help="text (one per line) or JSONL with 'prompt'")
    p.add_argument("--batch", type=positive_int, default=4, help="number of sequences (>= 1)")
    p.add_argument("--seq-len", type=positive_int, default=32, help="tokens per sequence (>= 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    args = p.parse_args(argv)
    return run_tool("mismatch_report", lambda: _report(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
