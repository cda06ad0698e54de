"""Read and write HF safetensors checkpoint directories, lazily and with shape checks."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_qrl.models.hf_config import ModelArch
from megatron_qrl.models.mapping import expected_hf_shapes

INDEX_NAME = "model.safetensors.index.json"
# files that travel with the weights (config, tokenizer, generation defaults, chat template)
SIDE_FILE_GLOBS = ("config.json", "generation_config.json", "tokenizer*", "vocab.json",
                   "merges.txt", "special_tokens_map.json", "added_tokens.json",
                   "chat_template*")


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class CheckpointMismatchError(ValueError):
    """The safetensors files do not hold the tensors config.json describes."""


class HFCheckpointReader:
    """Lazy name -> tensor access over the ``*.safetensors`` files of an HF directory."""

    def __init__(self, hf_dir: str | Path) -> None:
        self.hf_dir = Path(hf_dir)
        index = self.hf_dir / INDEX_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.hf_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"{self.hf_dir}: no *.safetensors files (nor {INDEX_NAME}); --hf-dir must hold the "
                "model weights in safetensors format")
        self._file_of: dict[str, Path] = {}
        for fname in files:
            path = self.hf_dir / fname
            if not path.is_file():
                raise FileNotFoundError(f"{path} is listed in {INDEX_NAME} but does not exist")
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    self._file_of[key] = path

    def names(self) -> list[str]:
        """All tensor names in the checkpoint."""
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of ``name`` without reading its data."""
        with safe_open(str(self._path(name)), framework="pt") as handle:
            return tuple(handle.get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        """Stored dtype of ``name`` without reading its data."""
        with safe_open(str(self._path(name)), framework="pt") as handle:
            code = handle.get_slice(name).get_dtype()
        if code not in _SAFETENSORS_DTYPES:
            raise CheckpointMismatchError(f"{self._path(name)}: tensor {name} has dtype {code}, "
                                          f"expected one of {sorted(_SAFETENSORS_DTYPES)}")
        return _SAFETENSORS_DTYPES[code]

    def get(self, name: str) -> torch.Tensor:
        """The full tensor ``name``."""
        with safe_open(str(self._path(name)), framework="pt") as handle:
            return handle.get_tensor(name)

    def _path(self, name: str) -> Path:
        if name not in self._file_of:
            raise KeyError(f"{self.hf_dir}: tensor {name!r} not found in the safetensors files")
        return self._file_of[name]

    def check_against(self, arch: ModelArch) -> None:
        """Raise :class:`CheckpointMismatchError` on a missing, extra or mis-shaped tensor."""
        expected = expected_hf_shapes(arch)
        optional = {"lm_head.weight"} if arch.tie_word_embeddings else set()
        missing = [n for n in expected if n not in self._file_of]
        extra = [n for n in self._file_of if n not in expected and n not in optional]
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
        save_file(current, str(out / f"part-{len(shard_names):05d}.tmp"), metadata={"format": "pt"})
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
