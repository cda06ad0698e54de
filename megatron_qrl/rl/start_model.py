"""``--qrl-model checkpoint --qrl-checkpoint DIR``: the starting model and tokenizer of a run.

``DIR`` is an HF directory (``config.json`` + ``*.safetensors``) or a megatron_qrl checkpoint
(``megatron_qrl.json`` + ``hf/`` + ``model/``; megatron re-shards it to any TP/EP on load).
The tokenizer comes from ``DIR`` (or ``DIR/hf``): a tokenizer ``transformers.AutoTokenizer``
loads from local files only (never the hub), else the repo's char tokenizer file
(:data:`megatron_qrl.data.tokenizer.TOKENIZER_FILE`), else a clear error.

A UAQ scale already folded into the weights (QuRL eq. 10-12, docs/ALGORITHMS.md section 2) is
read from the checkpoint metadata (``uaq_scale``) or config.json
(:data:`megatron_qrl.models.convert.UAQ_CONFIG_KEY`); the driver refuses to apply UAQ again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_qrl.data.tokenizer import TOKENIZER_FILE, CharTokenizer
from megatron_qrl.models.hf_config import ModelArch, arch_from_dict
from megatron_qrl.models.hf_io import HF_VOCAB_FILES as _HF_VOCAB_FILES

__all__ = ["HFTokenizer", "StartCheckpoint", "load_start_weights", "load_tokenizer",
           "read_start_checkpoint"]



class HFTokenizer:
    """A ``transformers`` tokenizer with the interface the driver uses (:class:`CharTokenizer`'s).

    ``bos_id`` is None when the tokenizer has no BOS token (e.g. Qwen3); ``pad_id`` falls back
    to ``eos_id``. ``encode`` never adds special tokens (the driver adds BOS / EOS itself).
    """

    def __init__(self, tok: Any, source: str) -> None:
        if tok.eos_token_id is None:
            raise ValueError(f"--qrl-checkpoint {source}: the tokenizer has no eos_token; set "
                             "eos_token in its tokenizer_config.json")
        self.tok = tok
        self.bos_id: int | None = tok.bos_token_id
        self.eos_id: int = tok.eos_token_id
        self.pad_id: int = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Any) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)


def _try_auto_tokenizer(root: Path) -> tuple[Any, str | None]:
    """``(tokenizer or None, why it failed or None)``; local files only."""
    if not any((root / f).is_file() for f in _HF_VOCAB_FILES):
        return None, None
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, ImportError) as exc:
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if len(tok) < 2 or not tok.encode("1+1=2", add_special_tokens=False):
        return None, f"it built a tokenizer of {len(tok)} tokens that encodes '1+1=2' to nothing"
    return tok, None


def load_tokenizer(ckpt_dir: str | Path) -> CharTokenizer | HFTokenizer:
    """The tokenizer of ``ckpt_dir`` (or ``ckpt_dir/hf``); see the module docstring."""
    root = Path(ckpt_dir)
    tried = []
    for d in (root, root / "hf"):
        if not d.is_dir():
            continue
        tok, why = _try_auto_tokenizer(d)
        if tok is not None:
            return HFTokenizer(tok, str(root))
        if why:
            tried.append(f"AutoTokenizer on {d} failed ({why})")
        if (d / TOKENIZER_FILE).is_file():
            return CharTokenizer.load(d / TOKENIZER_FILE)
    detail = "; ".join(tried) if tried else f"none of {', '.join(_HF_VOCAB_FILES)} found"
    raise FileNotFoundError(
        f"--qrl-checkpoint {root}: no tokenizer: neither {root} nor {root / 'hf'} holds a "
        f"tokenizer transformers.AutoTokenizer loads from local files (tokenizer.json / "
        f"tokenizer.model / vocab.json + tokenizer_config.json) nor the char tokenizer "
        f"{TOKENIZER_FILE} ({detail}). Copy the source model's tokenizer files into {root}, "
        f"or write the char tokenizer with megatron_qrl.data.CharTokenizer().save('{root}')")


@dataclass(frozen=True)
class StartCheckpoint:
    """What a run starts from: the directory, its layout, HF config and recorded UAQ scale."""

    path: Path
    kind: str
    """``hf`` (safetensors directory) or ``megatron`` (megatron_qrl dist checkpoint)."""
    hf_config: dict[str, Any]
    arch: ModelArch
    metadata: dict[str, Any]
    uaq_scale: float | None
    """UAQ scale already folded into the weights (None: never scaled)."""


def _recorded_uaq(meta: dict[str, Any], cfg: dict[str, Any]) -> float | None:
    from megatron_qrl.models.convert import UAQ_CONFIG_KEY
    from megatron_qrl.quant.uaq import UAQ_METADATA_KEY, read_uaq_scale

    for raw in (meta.get(UAQ_METADATA_KEY), cfg.get(UAQ_CONFIG_KEY)):
        if raw is not None:
            scale = read_uaq_scale({UAQ_METADATA_KEY: raw})
            return None if scale == 1.0 else scale
    return None


def read_start_checkpoint(ckpt_dir: str | Path) -> StartCheckpoint:
    """Layout, HF config, architecture and UAQ record of ``--qrl-checkpoint`` (no weights read)."""
    from megatron_qrl.config.checkpoint_info import MEGATRON_QRL_METADATA, read_checkpoint_info

    root = Path(ckpt_dir)
    meta, cfg = read_checkpoint_info(root)
    kind = "megatron" if (root / MEGATRON_QRL_METADATA).is_file() else "hf"
    if kind == "hf" and not any(root.glob("*.safetensors")):
        raise FileNotFoundError(f"--qrl-checkpoint {root}: no *.safetensors files (an HF "
                                "directory needs config.json + safetensors weights)")
    where = root / ("hf/config.json" if kind == "megatron" else "config.json")
    return StartCheckpoint(root, kind, cfg, arch_from_dict(cfg, str(where)), meta,
                           _recorded_uaq(meta, cfg))


def check_uaq_once(start: StartCheckpoint, uaq_enabled: bool) -> None:
    """Raise ``AlreadyScaledError`` if UAQ is on and the weights already carry a scale."""
    from megatron_qrl.quant.uaq import UAQ_METADATA_KEY, check_not_already_scaled

    if uaq_enabled and start.uaq_scale is not None:
        check_not_already_scaled({UAQ_METADATA_KEY: start.uaq_scale},
                                 source=f"--qrl-checkpoint {start.path}")


def load_start_weights(module: torch.nn.Module, start: StartCheckpoint) -> None:
    """Copy the checkpoint's weights into the trainer's bare GPTModel ``module``.

    HF: lazy safetensors reads through ``models.streaming.load_hf_weights`` (sliced to this
    rank's shards). megatron_qrl: ``models.checkpoint.load_checkpoint`` into a plain model of
    the stored dtype (megatron re-shards to the job's TP/EP), then its HF tensors are copied
    into ``module`` (whose spec hooks may change its module names).
    """
    from megatron_qrl.models.streaming import (
        groups_from_parallel_state,
        iter_hf_tensors,
        load_hf_weights,
    )

    groups = groups_from_parallel_state(start.arch.num_layers)
    if start.kind == "hf":
        from megatron_qrl.models.hf_io import HFCheckpointReader

        reader = HFCheckpointReader(start.path)
        reader.check_against(start.arch)
        load_hf_weights(module, start.arch, reader.get, groups)
        return
    from megatron_qrl.models.checkpoint import DTYPES, load_checkpoint
    from megatron_qrl.models.runtime import build_model

    plain = build_model(start.arch, params_dtype=DTYPES[start.metadata.get("dtype", "float32")])
    load_checkpoint(plain, start.path)
    import dataclasses

    # the plain model holds every layer (no pipeline stage); ``module`` takes its stage's
    tensors = dict(iter_hf_tensors(plain, start.arch, dataclasses.replace(groups, stage=None)))
    del plain
    load_hf_weights(module, start.arch, tensors.__getitem__, groups)
