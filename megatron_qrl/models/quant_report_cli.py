"""``qrl-quant-report``: what each rollout format does to a model (:mod:`megatron_qrl.quant.report`).

Writes ``report.json`` and ``report.png`` to ``--out-dir`` (an existing report is replaced only
with ``--overwrite``). The config is read as every tool reads one (:mod:`.hf_config`: a
supported architecture, values of the right types, no experts on a dense model); ``--seq-len``
is bounded by the model's positions, ``--batch`` x ``--seq-len`` by :data:`MAX_TOKENS`, the
model by the free memory. A mistake in a flag or the config is one line and exit code 2
(``utils.cli.run_tool``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from ..quant import list_specs
from ..quant.report import DEFAULT_CONFIG, format_table, plot_report, run_report

__all__ = ["MAX_TOKENS", "check_inputs", "check_out_dir", "main"]

MAX_TOKENS = 65536
"""Most tokens (``--batch`` x ``--seq-len``) the CPU report runs: the logits of each format
are held in fp32 (tokens x vocab x 4 bytes, several times over)."""


def check_inputs(config: Path, batch: int, seq_len: int) -> None:
    """Refuse, before any work, a config the other tools refuse (unknown architecture, MoE
    fields on a dense one, wrong value types, invalid JSON), a ``--seq-len`` past the model's
    positions, more than :data:`MAX_TOKENS` tokens and a model larger than the free memory."""
    from .hf_config import load_hf_config
    from .mapping import expected_hf_shapes

    if not config.is_file():
        raise FileNotFoundError(f"--config {config}: file not found")
    _, arch = load_hf_config(config)
    if seq_len > arch.max_position_embeddings:
        raise ValueError(f"--seq-len {seq_len} is longer than the model's max_position_embeddings "
                         f"{arch.max_position_embeddings} ({config}); give --seq-len <= "
                         f"{arch.max_position_embeddings}")
    if batch * seq_len > MAX_TOKENS:
        raise ValueError(f"--batch {batch} x --seq-len {seq_len} = {batch * seq_len} tokens; the "
                         f"CPU report runs at most {MAX_TOKENS}: lower --batch or --seq-len")
    need = 3 * 4 * sum(math.prod(s) for s in expected_hf_shapes(arch).values())
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > free:
        raise ValueError(f"--config {config}: the report holds the model in fp32 three times "
                         f"({need / 2**30:.1f} GB) but {free / 2**30:.1f} GB of memory are free; "
                         "use a smaller config (fewer layers or experts)")


def check_out_dir(out_dir: Path, overwrite: bool) -> list[Path]:
    """``[report.json, report.png]`` in ``out_dir`` once it is known writable (created if
    missing); an existing report is replaced only with ``overwrite``."""
    from ..utils.io import atomic_write_bytes
    from ..utils.outdir import OutputDirError

    if os.path.lexists(out_dir) and not out_dir.is_dir():
        raise OutputDirError(f"--out-dir {out_dir} exists and is not a directory; remove it or "
                             "choose another --out-dir")
    outs = [out_dir / "report.json", out_dir / "report.png"]
    for path in outs:
        if os.path.lexists(path) and not overwrite:
            raise OutputDirError(f"--out-dir {out_dir} already holds {path.name}; choose a new "
                                 "--out-dir, or pass --overwrite to replace the report")
    out_dir.mkdir(parents=True, exist_ok=True)
    probe = out_dir / ".qrl-quant-report-probe"
    atomic_write_bytes(probe, b"")  # a read-only or forbidden --out-dir fails here, not at the end
    probe.unlink()
    return outs


def _report(args: argparse.Namespace) -> int:
    from ..utils.io import atomic_write_text

    check_inputs(args.config, args.batch, args.seq_len)
    json_path, png_path = check_out_dir(args.out_dir, args.overwrite)
    print(f"qrl-quant-report: model {args.config}, output directory {args.out_dir}")
    report = run_report(args.config, args.formats, args.batch, args.seq_len, args.seed)
    atomic_write_text(json_path, json.dumps(report, indent=2))
    plot_report(report, png_path)
    print(format_table(report))
    print(f"wrote {json_path} and {png_path}")
    bad = [f for f, r in report["formats"].items() if r["contract_mismatches"]]
    if bad:
        print(f"CONTRACT VIOLATED for {bad}: rollout weights differ from the trainer's")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    from ..utils.cli import positive_int, run_tool, tool_parser

    p = tool_parser(__doc__.split("\n\n")[0], prog="qrl-quant-report")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                   help="HF config.json of the model (random weights); default: a tiny Qwen3-MoE")
    p.add_argument("--formats", nargs="+", default=list_specs(), choices=list_specs())
    p.add_argument("--batch", type=positive_int, default=8, help="sequences (>= 1)")
    p.add_argument("--seq-len", type=positive_int, default=64,
                   help="tokens per sequence (>= 1, <= the model's max_position_embeddings)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=Path("outputs/quant_report"))
    p.add_argument("--overwrite", action="store_true",
                   help="replace report.json / report.png already in --out-dir")
    args = p.parse_args(argv)
    code: list[int] = [0]

    def work() -> None:
        code[0] = _report(args)

    return run_tool("qrl-quant-report", work, debug=args.debug) or code[0]


if __name__ == "__main__":
    raise SystemExit(main())
