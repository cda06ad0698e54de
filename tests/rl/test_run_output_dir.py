"""``--qrl-output-dir``: a non-empty directory that holds nothing of a qrl-train run is refused
(nothing in it touched); an empty one, a run's own and ``--qrl-resume`` are accepted."""

from __future__ import annotations

import pytest

from megatron_qrl.rl.checkpoint import CKPT_DIR, TOOL, prepare_output_dir
from megatron_qrl.utils.outdir import MARKER_NAME, read_marker


def _files(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_a_foreign_directory_is_refused_in_one_line_and_left_untouched(tmp_path):
    from megatron_qrl.config.run import RunConfig
    from megatron_qrl.rl.cli import error_line

    mine = tmp_path / "thesis"
    mine.mkdir()
    (mine / "chapter1.tex").write_text("precious")
    (mine / ".draft.tex.tmp-1").write_text("looks like a stale temporary file")
    before = _files(mine)
    with pytest.raises(FileExistsError) as info:
        prepare_output_dir(mine, resume=False)
    assert _files(mine) == before
    line, code = error_line(info.value, RunConfig(output_dir=str(mine)))
    assert code == 2 and "\n" not in line
    assert f"--qrl-output-dir {mine} is not empty" in line and "new or empty" in line


def test_empty_own_and_resumed_directories_are_accepted(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert prepare_output_dir(empty, resume=False) is False
    assert read_marker(empty)["tool"] == TOOL  # the run marks its directory
    (empty / "tensorboard").mkdir()  # a run of ours that crashed before its first record
    assert prepare_output_dir(empty, resume=False) is False

    crashed = tmp_path / "crashed"  # an older run (no marker): an empty metrics.jsonl
    crashed.mkdir()
    (crashed / "metrics.jsonl").write_text("")
    (crashed / "notes.txt").write_text("x")
    assert prepare_output_dir(crashed, resume=False) is False
    (tmp_path / "ck" / CKPT_DIR).mkdir(parents=True)
    (tmp_path / "ck" / "notes.txt").write_text("x")
    assert prepare_output_dir(tmp_path / "ck", resume=False) is False

    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    assert prepare_output_dir(other, resume=True) is False  # the user says it is the run's
    assert (other / "notes.txt").read_text() == "x" and (other / MARKER_NAME).is_file()
    assert prepare_output_dir(tmp_path / "new", resume=False) is False
    assert read_marker(tmp_path / "new")["tool"] == TOOL
