"""Export an HF checkpoint quantized with a QuantSpec: the directory SGLang loads directly.

Used for post-training quantization after RL (the rlquant study, docs/ALGORITHMS.md section 4)
and to start a low-bit rollout engine from disk. The packed tensors come from
:meth:`QuantSpec.pack_state_dict` — the same function weight sync uses — and config.json
gets the spec's ``quantization_config``. Output is written to a temporary sibling directory
and renamed into place only when complete; ``out`` must not overlap the input and an existing
``out`` is replaced only when it is an earlier export (:mod:`megatron_qrl.utils.outdir`).
The input must be full precision: a quantized export is refused (codes are not weights).

``calibrate`` (:mod:`.calibrate`): ``none`` packs the checkpoint's tensors as they are
(round-to-nearest, streamed); ``awq`` (w4a16) / ``smoothquant`` (int8) first rescale them with
ModelOpt on the calibration sequences (the whole checkpoint in memory), then pack them the
same way: the same tensor names, dtypes and ``quantization_config``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from ..quant import get_spec
from ..utils.disk import tree_bytes
from ..utils.outdir import safe_output_dir
from .calibrate import calibrate_tensors, check_method
from .hf_io import copy_side_files, open_hf_checkpoint, write_safetensors

TOOL = "export_quantized"


class ExportError(ValueError):
    """The export cannot proceed (bad input directory, format or output path)."""


def export_quantized(
    hf_dir: str | Path,
    fmt: str,
    out: str | Path,
    *,
    overwrite: bool = False,
    max_shard_bytes: int = 5 * 2**30,
    progress: bool = True,
    calibrate: str = "none",
    calib: Sequence[Sequence[int]] = (),
) -> Path:
    """Quantize ``hf_dir`` with format ``fmt`` into ``out``; return the output path.
    ``calib``: token-id sequences of the calibration forward loop (``calibrate`` not none)."""
    spec = get_spec(fmt)
    check_method(calibrate, fmt)
    hf_dir, out = Path(hf_dir), Path(out)
    if max_shard_bytes <= 0:
        raise ExportError(f"--max-shard-gb must be > 0 (got {max_shard_bytes} bytes)")
    cfg, _, reader = open_hf_checkpoint(hf_dir)
    with safe_output_dir(out, [hf_dir], tool=TOOL, overwrite=overwrite,
                         need_bytes=tree_bytes(hf_dir)) as tmp:
        stream = ((n, reader.get(n)) for n in tqdm(
            reader.names(), desc=f"quantize {fmt}", unit="tensor", disable=not progress))
        if calibrate != "none":
            stream = iter(calibrate_tensors(cfg, stream, calibrate, fmt, calib).items())
        write_safetensors(spec.pack_state_dict(stream), tmp, max_shard_bytes=max_shard_bytes)
        copy_side_files(hf_dir, tmp)
        qcfg = spec.hf_quantization_config()
        new_cfg = dict(cfg)
        if qcfg is not None:
            new_cfg["quantization_config"] = qcfg
        (tmp / "config.json").write_text(json.dumps(new_cfg, indent=2) + "\n")
    return out
