"""``qrl-quant-report`` answers a mistake with ONE line and exit code 2, before any work, and
never replaces an existing report without ``--overwrite``."""

from __future__ import annotations

import errno
import json
import os
import pathlib
from pathlib import Path

import pytest

from megatron_qrl.models import quant_report_cli as tool
from megatron_qrl.quant.report import DEFAULT_CONFIG
from tests.tools.test_tools_errors import one_line
from tests.tools.test_tools_safety import run

QUICK = ["--formats", "bf16", "int8", "--batch", "1", "--seq-len", "4"]


def _config(tmp_path: Path, **changes) -> Path:
    cfg = {**json.loads(DEFAULT_CONFIG.read_text()), **changes}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("argv, needles", [
    (["--batch", "0"], ("--batch", "must be an integer >= 1")),
    (["--seq-len", "-4"], ("--seq-len", "must be an integer >= 1")),
    (["--seq-len", "100000"], ("--seq-len 100000 is longer than the model's "
                               "max_position_embeddings",)),
    (["--batch", "1000000", "--seq-len", "8"], ("--batch 1000000 x --seq-len 8", "at most 65536")),
])
def test_bad_sizes(tmp_path, capsys, argv, needles):
    code, err = run(tool, [*argv, "--out-dir", str(tmp_path / "r")], capsys)
    one_line(code, err, *needles)
    assert not (tmp_path / "r").exists()


def test_a_huge_model_is_refused_before_it_is_built(tmp_path, capsys):
    cfg = _config(tmp_path, hidden_size=65536, intermediate_size=262144, head_dim=128,
                  num_attention_heads=512, num_key_value_heads=64, num_hidden_layers=200)
    code, err = run(tool, ["--config", str(cfg), *QUICK, "--out-dir", str(tmp_path / "r")], capsys)
    one_line(code, err, f"--config {cfg}: the report holds the model in fp32", "memory")


def test_bad_configs_are_refused_as_the_other_tools_refuse_them(tmp_path, capsys):
    out = ["--out-dir", str(tmp_path / "r")]
    bad = tmp_path / "bad.json"
    bad.write_text('{"architectures": ')
    code, err = run(tool, ["--config", str(bad), *QUICK, *out], capsys)
    one_line(code, err, f"{bad}: not valid JSON")
    llama = _config(tmp_path, architectures=["LlamaForCausalLM"], model_type="llama")
    code, err = run(tool, ["--config", str(llama), *QUICK, *out], capsys)
    one_line(code, err, "unknown architecture 'LlamaForCausalLM'")
    dense = _config(tmp_path, architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    code, err = run(tool, ["--config", str(dense), *QUICK, *out], capsys)
    one_line(code, err, "Qwen3ForCausalLM is a dense model but num_experts=")
    typed = _config(tmp_path, hidden_size="64")
    code, err = run(tool, ["--config", str(typed), *QUICK, *out], capsys)
    one_line(code, err, "hidden_size must be an integer, got '64'")
    assert not (tmp_path / "r").exists()


def test_out_dir_that_is_a_file_or_read_only(tmp_path, capsys, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    code, err = run(tool, [*QUICK, "--out-dir", str(afile)], capsys)
    one_line(code, err, f"--out-dir {afile} exists and is not a directory")
    assert afile.read_text() == "mine\n"

    ro = tmp_path / "ro"
    ro.mkdir()
    real_os_open, real_path_open = os.open, pathlib.Path.open

    def read_only(path, *a, **k):  # a read-only file system under ro/ (root ignores chmod)
        if str(path).startswith(str(ro)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return (real_path_open if isinstance(path, pathlib.Path) else real_os_open)(path, *a, **k)

    monkeypatch.setattr(os, "open", read_only)
    monkeypatch.setattr(pathlib.Path, "open", read_only)
    code, err = run(tool, [*QUICK, "--out-dir", str(ro)], capsys)
    one_line(code, err, "Read-only file system", "read-only")


def test_an_existing_report_is_replaced_only_with_overwrite(tmp_path, capsys):
    (tmp_path / "report.json").write_text('{"mine": true}\n')
    code, err = run(tool, [*QUICK, "--out-dir", str(tmp_path)], capsys)
    one_line(code, err, f"--out-dir {tmp_path} already holds report.json", "--overwrite")
    assert (tmp_path / "report.json").read_text() == '{"mine": true}\n'
    code, err = run(tool, [*QUICK, "--out-dir", str(tmp_path), "--overwrite"], capsys)
    assert code == 0, err
    assert "formats" in json.loads((tmp_path / "report.json").read_text())
