"""Read and write HF safetensors checkpoint directories, lazily and with shape checks."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_qrl.models.hf_config import ModelArch, load_hf_config
from megatron_qrl.models.mapping import expected_hf_shapes
from megatron_qrl.utils.io import follow_umask

INDEX_NAME = "model.safetensors.index.json"
# files that travel with the weights (config, tokenizer, generation defaults, chat template)
SIDE_FILE_GLOBS = ("config.json", "generation_config.json", "tokenizer*", "vocab.json",
                   "merges.txt", "special_tokens_map.json", "added_tokens.json",
                   "chat_template*")
HF_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""A directory without one of these has no HF vocabulary (transformers 5 then builds an empty
tokenizer from tokenizer_config.json alone, which encodes every text to no tokens)."""


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class CheckpointMismatchError(ValueError):
    """The safetensors files do not hold the tensors config.json describes."""


class CheckpointReadError(ValueError):
    """A checkpoint file is truncated, corrupted or not in the format its name says."""


class QuantizedCheckpointError(ValueError):
    """The directory is a quantized export (codes + scales), not full-precision weights."""


_USE_BF16 = ("Its tensors are quantized codes and scales, which this tool would misread as "
             "weights; pass the BF16 checkpoint it was exported from")
_CODE_DTYPES = ("I", "U", "F8", "F6", "F4")
"""safetensors dtype codes of quantized codes (integers, packed integers, FP8/FP6/FP4)."""
_PACKED_LEAF = re.compile(r"(_scale|_scale_inv|_scale_2|_packed|_shape|zero_point|_g_idx)$")
"""Tensor-name endings of quantization leaves (ModelOpt, compressed-tensors, FP8 exports)."""


@contextlib.contextmanager
def _open(path: Path) -> Iterator:
    """``safe_open(path)``; a truncated / corrupted file is a :class:`CheckpointReadError`."""
    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own SafetensorError (an Exception)
        raise CheckpointReadError(f"{path}: not a readable safetensors file ({exc}); the file is "
                                  "truncated or corrupted: re-download or re-write it") from None
    with handle:
        yield handle


def refuse_quantized_config(cfg: dict, hf_dir: str | Path) -> None:
    """Raise :class:`QuantizedCheckpointError` when config.json has a ``quantization_config``."""
    qcfg = cfg.get("quantization_config")
    if qcfg:
        method = qcfg.get("quant_method") if isinstance(qcfg, dict) else qcfg
        raise QuantizedCheckpointError(
            f"{Path(hf_dir) / 'config.json'} already has a quantization_config (quant_method "
            f"{method!r}): {hf_dir} is a quantized export. {_USE_BF16}")


def open_hf_checkpoint(hf_dir: str | Path) -> tuple[dict, ModelArch, HFCheckpointReader]:
    """``(config, arch, reader)`` of a full-precision HF directory, checked: no quantization
    config, no quantized tensors, every tensor present with the shape config.json implies."""
    cfg, arch = load_hf_config(hf_dir)
    refuse_quantized_config(cfg, hf_dir)
    reader = HFCheckpointReader(hf_dir)
    reader.check_against(arch)
    return cfg, arch, reader


class HFCheckpointReader:
    """Lazy name -> tensor access over the ``*.safetensors`` files of an HF directory."""

    def __init__(self, hf_dir: str | Path) -> None:
        self.hf_dir = Path(hf_dir)
        index = self.hf_dir / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointReadError(f"{index}: not a safetensors index ({exc!r}); restore the "
                                          "file or remove it if there is one *.safetensors file") from None
        else:
            files = sorted(p.name for p in self.hf_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"{self.hf_dir}: no *.safetensors files (nor {INDEX_NAME}); --hf-dir must hold the "
                "model weights in safetensors format")
        self._file_of: dict[str, Path] = {}
        self._code_of: dict[str, str] = {}
        for fname in files:
            path = self.hf_dir / fname
            if not path.is_file():
                raise FileNotFoundError(f"{path} is listed in {INDEX_NAME} but does not exist")
            with _open(path) as handle:
                for key in handle.keys():
                    self._file_of[key] = path
                    self._code_of[key] = handle.get_slice(key).get_dtype()

    def names(self) -> list[str]:
        """All tensor names in the checkpoint."""
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of ``name`` without reading its data."""
        with _open(self._path(name)) as handle:
            return tuple(handle.get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        """Stored dtype of ``name`` without reading its data."""
        self._path(name)
        code = self._code_of[name]
        if code not in _SAFETENSORS_DTYPES:
            raise CheckpointMismatchError(f"{self._path(name)}: tensor {name} has dtype {code}, "
                                          f"expected one of {sorted(_SAFETENSORS_DTYPES)}")
        return _SAFETENSORS_DTYPES[code]

    def get(self, name: str) -> torch.Tensor:
        """The full tensor ``name``."""
        with _open(self._path(name)) as handle:
            try:
                return handle.get_tensor(name)
            except Exception as exc:  # safetensors' SafetensorError and friends
                raise CheckpointReadError(f"{self._path(name)}: tensor {name} cannot be read "
                                          f"({exc}); re-download or re-write the file") from None

    def _path(self, name: str) -> Path:
        if name not in self._file_of:
            raise KeyError(f"{self.hf_dir}: tensor {name!r} not found in the safetensors files")
        return self._file_of[name]

    def check_full_precision(self) -> None:
        """Raise :class:`QuantizedCheckpointError` naming a tensor stored as codes (int / fp8)."""
        for name, code in self._code_of.items():
            if code.startswith(_CODE_DTYPES):
                raise QuantizedCheckpointError(
                    f"{self._file_of[name]}: tensor {name} is stored as {code}, not as a "
                    f"floating-point weight: {self.hf_dir} is a quantized export. {_USE_BF16}")

    def check_against(self, arch: ModelArch) -> None:
        """Raise :class:`CheckpointMismatchError` on a missing, extra or mis-shaped tensor."""
        self.check_full_precision()
        expected = expected_hf_shapes(arch)
        optional = {"lm_head.weight"} if arch.tie_word_embeddings else set()
        missing = [n for n in expected if n not in self._file_of]
        extra = [n for n in self._file_of if n not in expected and n not in optional]
        packed = [n for n in extra if _PACKED_LEAF.search(n)]
        if packed:
            raise QuantizedCheckpointError(
                f"{self._file_of[packed[0]]}: tensor {packed[0]} is a quantization scale or packed "
                f"code, not a weight: {self.hf_dir} is a quantized export. {_USE_BF16}")
        if missing or extra:
            raise CheckpointMismatchError(
                f"{self.hf_dir}: tensors do not match config.json ({arch.architecture}): missing "
                f"{missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
                f"{'...' if len(extra) > 5 else ''}")
        for name, shape in expected.items():
            got = self.shape(name)
            if got != shape:
                raise CheckpointMismatchError(
                    f"{self._file_of[name]}: tensor {name} has shape {got} but config.json implies "
                    f"{shape}; the weights and config.json come from different models")


def copy_side_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy config/tokenizer files (not weights) from ``src`` to ``dst``; return their names."""
    copied = []
    for pattern in SIDE_FILE_GLOBS:
        for path in sorted(Path(src).glob(pattern)):
            if path.is_file():
                shutil.copy2(path, Path(dst) / path.name)
                copied.append(path.name)
    return copied


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path,
                     metadata: dict[str, str] | None = None) -> Path:
    """``safetensors.torch.save_file`` with the file mode of the umask (safetensors creates
    its files 0600, which an SGLang server under another account cannot read)."""
    save_file(tensors, str(path), metadata=metadata)
    follow_umask(path)
    return Path(path)


def write_safetensors(pairs: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path,
                      max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Write ``(name, tensor)`` pairs as HF safetensors shards (+ index when > 1 shard).

    Holds at most one shard in memory; returns the file names written.
    """
    out = Path(out_dir)
    current: dict[str, torch.Tensor] = {}
    shard_names: list[list[str]] = []
    size = total = 0

    def flush() -> None:
        save_safetensors(current, out / f"part-{len(shard_names):05d}.tmp", {"format": "pt"})
        shard_names.append(list(current))
        current.clear()

    for name, tensor in pairs:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            flush()
            size = 0
        current[name] = tensor.detach().to("cpu").contiguous()
        size += nbytes
        total += nbytes
    flush()
    n = len(shard_names)
    final = (["model.safetensors"] if n == 1 else
             [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
    weight_map = {}
    for i, (fin, names) in enumerate(zip(final, shard_names)):
        (out / f"part-{i:05d}.tmp").rename(out / fin)
        weight_map.update({k: fin for k in names})
    if n > 1:
        (out / INDEX_NAME).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return final
