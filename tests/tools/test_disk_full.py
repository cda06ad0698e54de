"""A full disk while a tool or qrl-train writes is ONE line: where, how much to free, which
flag to change (``no space left on OUT: free N or choose another --out``), whatever shape the
writer reports it in: safetensors' Rust text, torch's short-write RuntimeError (its OSError
only in ``__context__``, or lost in a writer thread), a plain OSError."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from tests.tools.test_make_random_checkpoint import TINY_MOE
from tests.tools.test_tools_errors import one_line
from tests.tools.test_tools_safety import run
from tools import convert_hf_to_megatron as to_megatron
from tools import export_quantized as export_tool
from tools import make_random_checkpoint


def _rust_disk_full(tensors, path, metadata=None):
    Path(path).write_bytes(b"partial")
    raise SafetensorError("Error while serializing: I/O error: No space left on device "
                          "(os error 28)")


def _no_leftovers(out: Path) -> None:
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.tmp-*"))


def test_make_random_checkpoint_and_export_on_a_full_disk(dense_hf, tmp_path, capsys,
                                                          monkeypatch):
    from megatron_qrl.models import hf_io

    monkeypatch.setattr(hf_io, "save_file", _rust_disk_full)
    out = tmp_path / "random"
    code, err = run(make_random_checkpoint, ["--config", str(TINY_MOE), "--out", str(out)],
                    capsys)
    one_line(code, err, f"no space left on {out}: free", "or choose another --out",
             "the output needs about")
    _no_leftovers(out)
    out = tmp_path / "int8"
    code, err = run(export_tool, ["--hf-dir", str(dense_hf), "--format", "int8", "--out",
                                  str(out)], capsys)
    one_line(code, err, f"no space left on {out}: free", "or choose another --out")
    _no_leftovers(out)


def test_convert_on_a_full_disk_whose_writer_lost_the_oserror(dense_hf, tmp_path, capsys,
                                                             monkeypatch):
    """The .distcp writer's worker reports only torch's short-write text; the output did not
    fit in the free space, so it is a full disk."""
    import megatron.core.dist_checkpointing.strategies.filesystem_async as writer
    import torch.distributed.checkpoint.filesystem as torch_writer

    import megatron_qrl.utils.disk as disk

    def short_write(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(writer, "_write_item", short_write)
    monkeypatch.setattr(torch_writer, "_write_item", short_write)
    monkeypatch.setattr(disk, "_free_bytes", lambda path: 1000)
    out = tmp_path / "mg"
    code, err = run(to_megatron, ["--hf-dir", str(dense_hf), "--out", str(out)], capsys)
    one_line(code, err, f"no space left on {out}: free", "or choose another --out")
    _no_leftovers(out)


def test_driver_checkpoint_on_a_full_disk_is_one_line_naming_the_output_dir(tmp_path,
                                                                           monkeypatch):
    from megatron_qrl.config.run import RunConfig
    from megatron_qrl.rl.checkpoint import save_driver_checkpoint
    from megatron_qrl.rl.cli import error_line

    def torch_save_on_a_full_disk(obj, fh, *a, **k):  # what torch.save does on ENOSPC
        try:
            fh.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:  # the OSError stays as the RuntimeError's __context__
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos "  # noqa: B904
                               "704 vs 598")

    monkeypatch.setattr(torch, "save", torch_save_on_a_full_disk)
    out = tmp_path / "run"
    with pytest.raises(OSError) as info:
        save_driver_checkpoint(out, 2, {"model": {"w": torch.zeros(1000)}}, {"qrl_seed": 0})
    line, code = error_line(info.value, RunConfig(output_dir=str(out)))
    assert code == 2 and "\n" not in line
    assert line.startswith(f"no space left on {out}: free ")
    assert "or choose another --qrl-output-dir" in line
    assert not [p for p in (out / "checkpoints").iterdir()]
