"""Export an HF checkpoint quantized with a QuantSpec: the directory SGLang loads directly.

Used for post-training quantization after RL (the rlquant study, ALGORITHMS.md section 4)
and to start a low-bit rollout engine from disk. The packed tensors come from
:meth:`QuantSpec.pack_state_dict` — the same function weight sync uses — and config.json
gets the spec's ``quantization_config``. Output is written to a temporary sibling directory
and renamed into place only when complete (:func:`~megatron_qrl.utils.io.atomic_directory`).
"""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from ..quant import get_spec
from ..utils.io import atomic_directory
from .hf_config import load_hf_config
from .hf_io import HFCheckpointReader, copy_side_files, write_safetensors


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
) -> Path:
    """Quantize ``hf_dir`` with format ``fmt`` into ``out``; return the output path."""
    spec = get_spec(fmt)
    hf_dir, out = Path(hf_dir), Path(out)
    cfg, arch = load_hf_config(hf_dir)
    if cfg.get("quantization_config"):
        raise ExportError(
            f"{hf_dir}/config.json already has a quantization_config "
            f"({cfg['quantization_config'].get('quant_method')}); export from the BF16 checkpoint"
        )
    reader = HFCheckpointReader(hf_dir)
    reader.check_against(arch)
    if out.exists() and not overwrite:
        raise ExportError(f"--out {out} already exists; remove it or pass --overwrite")
    with atomic_directory(out, overwrite=overwrite) as tmp:
        stream = ((n, reader.get(n)) for n in tqdm(
            reader.names(), desc=f"quantize {fmt}", unit="tensor", disable=not progress))
        write_safetensors(spec.pack_state_dict(stream), tmp, max_shard_bytes=max_shard_bytes)
        copy_side_files(hf_dir, tmp)
        qcfg = spec.hf_quantization_config()
        new_cfg = dict(cfg)
        if qcfg is not None:
            new_cfg["quantization_config"] = qcfg
        (tmp / "config.json").write_text(json.dumps(new_cfg, indent=2) + "\n")
    return out
