"""Every file a tool writes gets the mode a plain ``open`` gives under the umask (0644 under
umask 022), so an SGLang server under another account can read the weights: safetensors'
writer creates its files 0600."""

from __future__ import annotations

import stat
from pathlib import Path

from megatron_qrl.utils import io as qio
from tests.tools.test_make_random_checkpoint import TINY_MOE
from tools import convert_hf_to_megatron as to_megatron
from tools import convert_megatron_to_hf as to_hf
from tools import export_quantized as export_tool
from tools import make_random_checkpoint


def assert_umask_modes(root: Path) -> None:
    want = 0o666 & ~qio._UMASK
    files = [p for p in root.rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    bad = {str(p.relative_to(root)): oct(stat.S_IMODE(p.stat().st_mode)) for p in files
           if stat.S_IMODE(p.stat().st_mode) != want}
    assert not bad, f"expected {oct(want)}: {bad}"


def test_hf_outputs_follow_the_umask(dense_hf, tmp_path):
    assert make_random_checkpoint.main(["--config", str(TINY_MOE), "--layers", "1", "--out",
                                        str(tmp_path / "random"), "--shard-gb", "0.0001"]) == 0
    assert_umask_modes(tmp_path / "random")
    assert export_tool.main(["--hf-dir", str(dense_hf), "--format", "int8", "--out",
                             str(tmp_path / "int8")]) == 0
    assert_umask_modes(tmp_path / "int8")
    assert to_megatron.main(["--hf-dir", str(dense_hf), "--out", str(tmp_path / "mg")]) == 0
    assert to_hf.main(["--megatron-dir", str(tmp_path / "mg"), "--out", str(tmp_path / "back")]) == 0
    assert_umask_modes(tmp_path / "back")

