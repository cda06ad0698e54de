"""qrl-train answers these user mistakes with ONE line (exit 2) before any training."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron_qrl.rl.cli import main
from tests.tools.test_tools_errors import one_line


def _train(argv: list[str], capsys, tmp_path: Path) -> tuple[int, str]:
    try:
        code = main([*argv, "--qrl-steps", "1", "--qrl-output-dir", str(tmp_path / "run"),
                     "--qrl-no-progress"])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def test_a_quantized_export_as_checkpoint(dense_hf, tmp_path, capsys):
    from megatron_qrl.data import CharTokenizer
    from tools import export_quantized

    hf = Path(shutil.copytree(dense_hf, tmp_path / "hf"))
    CharTokenizer().save(hf, hf=True)  # travels into the export: only the weights are wrong
    assert export_quantized.main(["--hf-dir", str(hf), "--format", "fp8", "--out",
                                  str(tmp_path / "fp8")]) == 0
    code, err = _train(["--qrl-model", "checkpoint", "--qrl-checkpoint", str(tmp_path / "fp8"),
                        "--qrl-routing-replay", "off"], capsys, tmp_path)
    one_line(code, err, f"--qrl-checkpoint {tmp_path / 'fp8'}", "is a quantized export")


def test_a_config_value_of_the_wrong_type(dense_hf, tmp_path, capsys):
    ck = Path(shutil.copytree(dense_hf, tmp_path / "ck"))
    cfg = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**cfg, "hidden_size": str(cfg["hidden_size"])}))
    code, err = _train(["--qrl-model", "checkpoint", "--qrl-checkpoint", str(ck),
                        "--qrl-routing-replay", "off"], capsys, tmp_path)
    one_line(code, err, "hidden_size must be an integer, got '64'")


def test_an_unscorable_answer_is_refused_at_load(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "\\\\boxed{4"}\n')
    code, err = _train(["--qrl-task-prompts", str(prompts)], capsys, tmp_path)
    one_line(code, err, f"--qrl-task-prompts {prompts}, line 2", "cannot be scored")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("seed", ["18446744073709551616", "9223372036854775808"])
def test_a_seed_beyond_64_bits(tmp_path, capsys, seed):
    code, err = _train(["--qrl-seed", seed], capsys, tmp_path)
    one_line(code, err, "--qrl-seed must be at most 2**63 - 1")


def test_world_size_without_torchrun(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for k in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    code, err = _train([], capsys, tmp_path)
    one_line(code, err, "WORLD_SIZE=2 is set", "RANK, MASTER_ADDR, MASTER_PORT",
             "torchrun --nproc-per-node 2")
