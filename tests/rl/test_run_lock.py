"""One run per output directory, and outputs apart from inputs.

The lock (megatron_qrl.utils.run_lock): a held lock refuses a second run naming the owner's
pid / host / start time; a lock of a dead pid on this host is stale and taken over; a lock of
another host is never broken. qrl-train: a second run (here a ``--qrl-resume`` while the
first holds the lock) is ONE line, and ``--qrl-output-dir`` equal to, inside or around an
input (``--qrl-checkpoint``, ``--qrl-task-prompts``) is ONE line naming both flags.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from megatron_qrl.rl.cli import main
from megatron_qrl.utils.outdir import MARKER_NAME
from megatron_qrl.utils.run_lock import LOCK_NAME, RunLockError, acquire_run_lock

TINY = ["--qrl-preset", "tiny-cpu", "--qrl-sft-steps", "1", "--qrl-prompts-per-step", "2",
        "--qrl-rollout-n-samples-per-prompt", "4", "--qrl-rollout-max-new-tokens", "4",
        "--qrl-micro-batch-size", "4", "--qrl-steps", "1", "--qrl-no-progress"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_held_lock_refuses_naming_the_owner_and_is_released(tmp_path):
    lock = acquire_run_lock(tmp_path / "run", log=lambda _m: None)
    with pytest.raises(RunLockError) as info:
        acquire_run_lock(tmp_path / "run", log=lambda _m: None)
    held = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
    msg = str(info.value)
    assert f"pid {held['pid']}" in msg and socket.gethostname() in msg and held["started"] in msg
    assert "--qrl-output-dir" in msg and "\n" not in msg
    lock.release()
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    acquire_run_lock(tmp_path / "run", log=lambda _m: None).release()


def test_a_stale_lock_of_this_host_is_taken_over(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    pid = _dead_pid()
    (d / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": socket.gethostname(),
                                           "started": "earlier", "token": "old"}))
    said: list[str] = []
    lock = acquire_run_lock(d, log=said.append)
    assert len(said) == 1 and "stale" in said[0] and f"pid {pid}" in said[0]
    assert json.loads((d / LOCK_NAME).read_text())["token"] == lock.token
    assert sorted(p.name for p in d.iterdir()) == [LOCK_NAME]  # nothing left aside


def test_a_lock_of_another_host_is_never_broken(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / LOCK_NAME).write_text(json.dumps({"pid": _dead_pid(), "host": "node-elsewhere",
                                           "started": "earlier", "token": "x"}))
    with pytest.raises(RunLockError, match="node-elsewhere"):
        acquire_run_lock(d, log=lambda _m: None)


def _one_line(capsys, code: int, rc: int) -> str:
    err = capsys.readouterr().err
    assert rc == code and "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("qrl-train: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_a_second_run_on_a_locked_directory_is_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / MARKER_NAME).write_text(json.dumps({"tool": "qrl-train", "version": "0"}))
    first = acquire_run_lock(out, log=lambda _m: None)  # the first run, still running
    try:
        rc = main([*TINY, "--qrl-output-dir", str(out), "--qrl-resume"])
        line = _one_line(capsys, 2, rc)
    finally:
        first.release()
    assert "in use by another qrl-train run" in line and "--qrl-output-dir" in line
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("where", ["same", "around"])
def test_output_dir_and_prompts_file_never_overlap(tmp_path, capsys, where):
    data = tmp_path / "data"
    data.mkdir()
    prompts = data / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    out = prompts if where == "same" else data  # the prompts file inside the output
    rc = main([*TINY, "--qrl-output-dir", str(out), "--qrl-task-prompts", str(prompts)])
    line = _one_line(capsys, 2, rc)
    assert "--qrl-output-dir" in line and "--qrl-task-prompts" in line
    assert sorted(p.name for p in data.iterdir()) == ["p.jsonl"]


def test_output_dir_inside_the_start_checkpoint_is_one_line(tmp_path, capsys):
    from megatron_qrl.data import CharTokenizer
    from tests.helpers.tiny_hf import make_tiny_hf

    hf = make_tiny_hf(tmp_path / "hf", "moe")
    CharTokenizer().save(hf, hf=False)
    before = sorted(p.name for p in hf.iterdir())
    for out in (hf, hf / "run"):
        rc = main([*TINY, "--qrl-model", "checkpoint", "--qrl-checkpoint", str(hf),
                   "--qrl-output-dir", str(out)])
        line = _one_line(capsys, 2, rc)
        assert "--qrl-output-dir" in line and "--qrl-checkpoint" in line
    assert sorted(p.name for p in hf.iterdir()) == before
