"""Shipped fused-MoE kernel configurations, selected automatically when an engine starts.

``tools/tune_fused_moe.py`` writes SGLang-named JSON files (``E=..,N=..,device_name=..,
dtype=...json``) into ``megatron_qrl/rollout_sglang/kernels/configs/triton_<version>/``. SGLang
reads configurations from one directory (``SGLANG_MOE_CONFIG_DIR``), so
:func:`config_dir_for_engine` builds a merged view — SGLang's own shipped files plus ours,
ours winning on a name clash — and the engine points ``SGLANG_MOE_CONFIG_DIR`` at it. A
directory the user already set in ``SGLANG_MOE_CONFIG_DIR`` is respected untouched.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

__all__ = ["SHIPPED", "config_dir_for_engine", "sglang_config_root", "write_config"]

SHIPPED = Path(__file__).with_name("configs")
"""Our tuned files: ``SHIPPED/triton_<x_y_z>/<SGLang file name>``."""


def sglang_config_root() -> Path | None:
    """SGLang's ``.../triton_utils`` directory (holding ``configs/``), without importing it."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    path = root / "srt" / "layers" / "moe" / "moe_runner" / "triton_utils"
    return path if (path / "configs").is_dir() else None


def write_config(triton_version: str, file_name: str, best: dict[int, dict],
                 root: Path = SHIPPED) -> Path:
    """Write ``{M: config}`` as SGLang's JSON (keys are strings of M), atomically."""
    d = root / f"triton_{triton_version.replace('.', '_')}"
    d.mkdir(parents=True, exist_ok=True)
    path = d / file_name
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({str(m): best[m] for m in sorted(best)}, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def _link(src: Path, dst: Path) -> None:
    if dst.is_symlink() or dst.exists():
        dst.unlink()
    dst.symlink_to(src)


def merge_config_dirs(sglang_root: Path | None, shipped: Path, out: Path) -> Path:
    """``out/configs/triton_*/``: SGLang's files, then ours on top (symlinks). Returns ``out``."""
    configs = out / "configs"
    configs.mkdir(parents=True, exist_ok=True)
    versions: dict[str, list[Path]] = {}
    for base in ([sglang_root / "configs"] if sglang_root else []) + [shipped]:
        if base.is_dir():
            for vdir in sorted(base.glob("triton_*")):
                versions.setdefault(vdir.name, []).append(vdir)
    for name, dirs in versions.items():
        target = configs / name
        target.mkdir(exist_ok=True)
        for vdir in dirs:  # later (ours) overwrite earlier (SGLang's)
            for f in vdir.glob("*.json"):
                _link(f.resolve(), target / f.name)
    return out


def config_dir_for_engine(cache: Path | None = None) -> str | None:
    """The ``SGLANG_MOE_CONFIG_DIR`` an engine should use, or None to leave SGLang's default.

    None when the user set ``SGLANG_MOE_CONFIG_DIR`` or no tuned file ships in this checkout.
    """
    if os.environ.get("SGLANG_MOE_CONFIG_DIR"):
        return None
    if not any(SHIPPED.glob("triton_*/*.json")):
        return None
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / \
        "megatron_qrl" / "sglang_moe_configs"
    return str(merge_config_dirs(sglang_config_root(), SHIPPED, cache))
