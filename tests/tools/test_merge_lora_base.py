"""tools/merge_lora.py finds the run's base wherever it is started from, refuses a base of
another shape with one line naming its own ``--base`` flag, and writes readable files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.tools.test_file_modes import assert_umask_modes
from tests.tools.test_tools_errors import one_line
from tests.tools.test_tools_safety import run
from tools import make_random_checkpoint, merge_lora

TINY = REPO / "megatron_qrl" / "data" / "configs" / "tiny_qwen3.json"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """A LoRA run started, from its parent directory, with a RELATIVE --qrl-checkpoint."""
    root = tmp_path_factory.mktemp("lora")
    assert make_random_checkpoint.main(["--config", str(TINY), "--out", str(root / "base")]) == 0
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_qrl.rl.cli", "--qrl-preset", "tiny-cpu,qerl",
         "--qrl-model", "checkpoint", "--qrl-checkpoint", "base", "--qrl-routing-replay", "off",
         "--qrl-sft-steps", "2", "--qrl-steps", "1", "--qrl-prompts-per-step", "2",
         "--qrl-rollout-n-samples-per-prompt", "4", "--qrl-rollout-max-new-tokens", "4",
         "--qrl-micro-batch-size", "4", "--qrl-output-dir", "run", "--qrl-no-progress"],
        cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "run"


@pytest.mark.slow
def test_merge_from_another_directory_finds_the_relative_base(lora_run, tmp_path, capsys,
                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = run(merge_lora, ["--run-dir", str(lora_run), "--out", "merged",
                                 "--adapter-out", "adapter"], capsys)
    assert code == 0, err
    assert_umask_modes(tmp_path / "merged")
    assert_umask_modes(tmp_path / "adapter")


@pytest.mark.slow
def test_merge_refuses_a_base_of_another_shape(lora_run, tmp_path, capsys):
    other = tmp_path / "other"
    assert make_random_checkpoint.main(["--config", str(TINY), "--layers", "3", "--out",
                                        str(other)]) == 0
    code, err = run(merge_lora, ["--run-dir", str(lora_run), "--out", str(tmp_path / "m"),
                                 "--base", str(other)], capsys)
    one_line(code, err, f"--base ({other}) holds a model of another shape",
             "num_hidden_layers 3 (the run's: 2)", "pass --base DIR")
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
def test_merge_without_the_base_names_its_own_flag(lora_run, tmp_path, capsys, monkeypatch):
    moved = Path(shutil.copytree(lora_run, tmp_path / "elsewhere" / "run"))
    monkeypatch.chdir(tmp_path)
    code, err = run(merge_lora, ["--run-dir", str(moved), "--out", "m"], capsys)
    one_line(code, err, "the run's --qrl-checkpoint base not found", "pass --base DIR")
