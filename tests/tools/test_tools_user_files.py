"""tools/ leave the user's files alone and refuse impossible sizes up front (one line, exit 2).

``mismatch_report --out`` replaced an existing file without ``--overwrite``; ``--seq-len``
past the model's positions ran unbounded; ``--prompts`` with no tokenizer in ``--hf-dir``
encoded every prompt to token 0.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.tools.test_tools_errors import one_line
from tests.tools.test_tools_safety import run
from tools import mismatch_report


@pytest.fixture
def hf(tmp_path, dense_hf) -> Path:
    return Path(shutil.copytree(dense_hf, tmp_path / "hf"))


def _report(hf: Path, out: Path, *extra: str) -> list[str]:
    return ["--hf-dir", str(hf), "--format", "int8", "--out", str(out), "--batch", "1",
            "--seq-len", "4", *extra]


def test_mismatch_report_keeps_an_existing_out_file_without_overwrite(hf, tmp_path, capsys):
    thesis = tmp_path / "thesis.md"
    thesis.write_text("two years of work\n")
    code, err = run(mismatch_report, _report(hf, thesis), capsys)
    one_line(code, err, f"--out {thesis} already exists", "--overwrite")
    assert thesis.read_text() == "two years of work\n"
    code, err = run(mismatch_report, _report(hf, thesis, "--overwrite"), capsys)
    assert code == 0, err
    assert thesis.read_bytes().startswith(b"\x89PNG")


def test_mismatch_report_refuses_a_seq_len_past_the_model_positions(hf, tmp_path, capsys):
    argv = _report(hf, tmp_path / "r.png")
    argv[argv.index("--seq-len") + 1] = "65"
    code, err = run(mismatch_report, argv, capsys)
    one_line(code, err, "--seq-len 65", "max_position_embeddings 64", "--seq-len <= 64")
    assert not (tmp_path / "r.png").exists()


def test_mismatch_report_prompts_need_a_tokenizer(hf, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1+1=\n")
    assert not any((hf / n).exists() for n in ("tokenizer.json", "vocab.json", "tokenizer.model"))
    code, err = run(mismatch_report, _report(hf, tmp_path / "r.png", "--prompts", str(prompts)),
                    capsys)
    one_line(code, err, f"--prompts needs a tokenizer in --hf-dir {hf}", "tokenizer.json",
             "drop --prompts")
    assert not (tmp_path / "r.png").exists()
