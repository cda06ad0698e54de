"""HF safetensors directory <-> megatron_qrl dist checkpoint (the logic behind tools/).

Both directions run in one process at TP = EP = 1 (megatron re-shards the dist checkpoint
when a job loads it at another layout), write into a temporary directory next to the output
and rename it when complete. UAQ (QuRL, docs/ALGORITHMS.md section 2) is applied to the HF
state dict on the way in, at most once: the scale is recorded in the checkpoint metadata and
in the travelling config.json (key :data:`UAQ_CONFIG_KEY`), and a second application is refused.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from megatron_qrl.models.checkpoint import load_checkpoint, read_metadata, save_checkpoint
from megatron_qrl.models.hf_config import load_hf_config
from megatron_qrl.models.hf_io import (
    HFCheckpointReader,
    copy_side_files,
    open_hf_checkpoint,
    write_safetensors,
)
from megatron_qrl.models.mapping import count_parameters, expected_hf_shapes
from megatron_qrl.quant.uaq import apply_uaq
from megatron_qrl.utils.disk import tree_bytes
from megatron_qrl.utils.finite import require_finite
from megatron_qrl.utils.outdir import safe_output_dir

TO_MEGATRON = "convert_hf_to_megatron"
TO_HF = "convert_megatron_to_hf"

UAQ_CONFIG_KEY = "megatron_qrl_uaq_scale"
"""config.json key recording the UAQ scale already folded into the weights."""


class UAQAlreadyAppliedError(ValueError):
    """--uaq-scale was given for weights that already carry a UAQ scale."""


def _uaq_state(get_tensor: Callable, reader: HFCheckpointReader, cfg: dict[str, Any],
               scale: float) -> dict:
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"--uaq-scale must be a finite number > 0, got {scale}")
    state = {name: get_tensor(name) for name in reader.names()}
    return apply_uaq(state, cfg, scale)


def _finite_reads(get_tensor: Callable[[str], torch.Tensor], source: Path) -> Callable:
    """``get_tensor`` that refuses a tensor holding NaN / Inf, naming it and ``source``."""
    def get(name: str) -> torch.Tensor:
        tensor = get_tensor(name)
        require_finite(tensor, f"{source}: tensor {name}", "fix or replace the checkpoint")
        return tensor
    return get


def _finite_pairs(pairs: Iterable[tuple[str, torch.Tensor]], source: Path) -> Iterator:
    for name, tensor in pairs:
        require_finite(tensor, f"{source}: tensor {name}", "fix or replace the checkpoint")
        yield name, tensor


def convert_hf_to_megatron(hf_dir: str | Path, out: str | Path, uaq_scale: float | None = None,
                           show_progress: bool = False, overwrite: bool = False) -> Path:
    """Convert an HF Qwen3 / Qwen3-MoE directory to a megatron_qrl checkpoint at ``out``.

    ``out`` must not overlap ``hf_dir``; an existing ``out`` is replaced only with
    ``overwrite`` and only when it is an earlier output of this converter
    (:func:`~megatron_qrl.utils.outdir.check_output_dir`). Non-finite weights are refused.
    """
    from megatron_qrl.models.runtime import build_model, single_process_megatron
    from megatron_qrl.models.streaming import load_hf_weights

    hf_dir = Path(hf_dir)
    cfg, arch, reader = open_hf_checkpoint(hf_dir)
    previous = cfg.get(UAQ_CONFIG_KEY)
    if uaq_scale is not None and previous is not None:
        raise UAQAlreadyAppliedError(
            f"{hf_dir}/config.json: UAQ scale {previous} is already folded into these weights "
            f"({UAQ_CONFIG_KEY}); drop --uaq-scale (re-applying would compound the scaling)")
    get_tensor = _finite_reads(reader.get, hf_dir)
    if uaq_scale is not None:
        get_tensor = _uaq_state(get_tensor, reader, cfg, uaq_scale).__getitem__
        cfg = {**cfg, UAQ_CONFIG_KEY: uaq_scale}
    # the stored dtype, not config.json's: the conversion must be bit-exact
    dtype = reader.dtype("model.embed_tokens.weight")
    meta = {"architecture": arch.architecture, "dtype": str(dtype).removeprefix("torch."),
            "saved_layout": {"tp": 1, "ep": 1}, "uaq_scale": cfg.get(UAQ_CONFIG_KEY),
            "source": str(hf_dir.resolve())}
    with safe_output_dir(out, [hf_dir], tool=TO_MEGATRON, overwrite=overwrite,
                         need_bytes=tree_bytes(hf_dir)) as tmp, \
            single_process_megatron():
        model = build_model(arch, params_dtype=dtype)
        names = [n for n, _ in model.named_parameters()]
        with tqdm(total=len(names), desc="HF -> Megatron", disable=not show_progress) as bar:
            load_hf_weights(model, arch, get_tensor, progress=lambda _: bar.update())
        (tmp / "hf").mkdir()
        copy_side_files(hf_dir, tmp / "hf")
        (tmp / "hf" / "config.json").write_text(json.dumps(cfg, indent=2))
        save_checkpoint(model, tmp, meta)
    return Path(out)


def convert_megatron_to_hf(megatron_dir: str | Path, out: str | Path,
                           show_progress: bool = False, overwrite: bool = False) -> Path:
    """Convert a megatron_qrl checkpoint back to an HF safetensors directory at ``out``.

    Output rules as :func:`convert_hf_to_megatron`; a non-finite weight is refused by name.
    """
    from megatron_qrl.models.checkpoint import DTYPES
    from megatron_qrl.models.runtime import build_model, single_process_megatron
    from megatron_qrl.models.streaming import iter_hf_tensors

    megatron_dir = Path(megatron_dir)
    meta, _, arch = read_metadata(megatron_dir)
    n_tensors = len(expected_hf_shapes(arch))
    with safe_output_dir(out, [megatron_dir], tool=TO_HF, overwrite=overwrite,
                         need_bytes=tree_bytes(megatron_dir / "model")) as tmp, \
            single_process_megatron():
        model = build_model(arch, params_dtype=DTYPES[meta["dtype"]])
        load_checkpoint(model, megatron_dir)
        pairs = tqdm(_finite_pairs(iter_hf_tensors(model, arch), megatron_dir), total=n_tensors,
                     desc="Megatron -> HF", disable=not show_progress)
        write_safetensors(pairs, tmp)
        copy_side_files(megatron_dir / "hf", tmp)
    return Path(out)


def dry_run(hf_dir: str | Path) -> dict[str, int]:
    """Build the Megatron model of ``hf_dir``'s config on the meta device; count parameters.

    Returns ``{"total", "active"}`` from the built model; raises if they disagree with the
    closed-form count of the HF tensors (a mapping or config bug).
    """
    from megatron_qrl.models.runtime import meta_parameter_counts, single_process_megatron

    _, arch = load_hf_config(hf_dir)
    with single_process_megatron():
        total, active = meta_parameter_counts(arch)
    expected = count_parameters(arch)
    if (total, active) != expected:
        raise RuntimeError(f"Megatron model has (total, active)=({total}, {active}) parameters, "
                           f"the HF tensors of config.json imply {expected}")
    return {"total": total, "active": active}
