"""HF safetensors directory <-> megatron_qrl dist checkpoint (the logic behind tools/).

Both directions run in one process at TP = EP = 1 (megatron re-shards the dist checkpoint
when a job loads it at another layout), write into a temporary directory next to the output
and rename it when complete. UAQ (QuRL, ALGORITHMS.md section 2) is applied to the HF
state dict on the way in, at most once: the scale is recorded in the checkpoint metadata and
in the travelling config.json (key :data:`UAQ_CONFIG_KEY`), and a second application is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tqdm import tqdm

from megatron_qrl.models.checkpoint import (
    atomic_output_dir,
    load_checkpoint,
    read_metadata,
    save_checkpoint,
)
from megatron_qrl.models.hf_config import load_hf_config
from megatron_qrl.models.hf_io import HFCheckpointReader, copy_side_files, write_safetensors
from megatron_qrl.models.mapping import count_parameters, expected_hf_shapes
from megatron_qrl.quant.uaq import apply_uaq

UAQ_CONFIG_KEY = "megatron_qrl_uaq_scale"
"""config.json key recording the UAQ scale already folded into the weights."""


class UAQAlreadyAppliedError(ValueError):
    """--uaq-scale was given for weights that already carry a UAQ scale."""


def _uaq_state(reader: HFCheckpointReader, cfg: dict[str, Any], scale: float) -> dict:
    if scale <= 0:
        raise ValueError(f"--uaq-scale must be > 0, got {scale}")
    state = {name: reader.get(name) for name in reader.names()}
    return apply_uaq(state, cfg, scale)


def convert_hf_to_megatron(hf_dir: str | Path, out: str | Path, uaq_scale: float | None = None,
                           show_progress: bool = False) -> Path:
    """Convert an HF Qwen3 / Qwen3-MoE directory to a megatron_qrl checkpoint at ``out``."""
    from megatron_qrl.models.runtime import build_model, single_process_megatron
    from megatron_qrl.models.streaming import load_hf_weights

    hf_dir = Path(hf_dir)
    cfg, arch = load_hf_config(hf_dir)
    reader = HFCheckpointReader(hf_dir)
    reader.check_against(arch)
    previous = cfg.get(UAQ_CONFIG_KEY)
    if uaq_scale is not None and previous is not None:
        raise UAQAlreadyAppliedError(
            f"{hf_dir}/config.json: UAQ scale {previous} is already folded into these weights "
            f"({UAQ_CONFIG_KEY}); drop --uaq-scale (re-applying would compound the scaling)")
    get_tensor = reader.get
    if uaq_scale is not None:
        get_tensor = _uaq_state(reader, cfg, uaq_scale).__getitem__
        cfg = {**cfg, UAQ_CONFIG_KEY: uaq_scale}
    # the stored dtype, not config.json's: the conversion must be bit-exact
    dtype = reader.dtype("model.embed_tokens.weight")
    meta = {"architecture": arch.architecture, "dtype": str(dtype).removeprefix("torch."),
            "saved_layout": {"tp": 1, "ep": 1}, "uaq_scale": cfg.get(UAQ_CONFIG_KEY),
            "source": str(hf_dir.resolve())}
    with single_process_megatron(), atomic_output_dir(out) as tmp:
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
                           show_progress: bool = False) -> Path:
    """Convert a megatron_qrl checkpoint back to an HF safetensors directory at ``out``."""
    from megatron_qrl.models.checkpoint import DTYPES
    from megatron_qrl.models.runtime import build_model, single_process_megatron
    from megatron_qrl.models.streaming import iter_hf_tensors

    megatron_dir = Path(megatron_dir)
    meta, _, arch = read_metadata(megatron_dir)
    n_tensors = len(expected_hf_shapes(arch))
    with single_process_megatron(), atomic_output_dir(out) as tmp:
        model = build_model(arch, params_dtype=DTYPES[meta["dtype"]])
        load_checkpoint(model, megatron_dir)
        pairs = tqdm(iter_hf_tensors(model, arch), total=n_tensors, desc="Megatron -> HF",
                     disable=not show_progress)
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
