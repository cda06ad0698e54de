"""qrl-train reliability: checksummed checkpoints, run identity, used output
directories, NaN guard, one-line errors.

Unit tests drive :mod:`megatron_qrl.rl.checkpoint` / :mod:`megatron_qrl.rl.guard` /
``cli.error_line`` directly; the end-to-end cases run qrl-train on the tiny CPU model (engine
double) in subprocesses, as tests/rl/test_rl_driver.py does.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_qrl.config import QrlArgumentError
from megatron_qrl.rl.checkpoint import (
    CKPT_DIR,
    DriverCheckpointError,
    load_driver_checkpoint,
    prepare_output_dir,
    save_driver_checkpoint,
)
from tests.helpers import HELPERS, REPO

FLAGS = {"qrl_lr": 1e-3, "qrl_seed": 7, "qrl_steps": 5}
MODEL = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts_per_tok": 2, "hidden_size": 32}


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((64, 64), value)}}


def _save(out: Path, step: int, **kw) -> Path:
    return save_driver_checkpoint(out, step, _state(float(step)), FLAGS, model_config=MODEL, **kw)


def _flip(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


def _load(out: Path, **kw) -> tuple[dict, list[str]]:
    lines: list[str] = []
    state = load_driver_checkpoint(out, FLAGS, MODEL, report=lines.append, **kw)
    return state, lines


def _names(out: Path) -> list[str]:
    return sorted(p.name for p in (out / CKPT_DIR).iterdir())


# --- checkpoints: integrity --------------------------------------------------------------

@pytest.mark.parametrize("damage", [_flip, _truncate])
def test_damaged_latest_falls_back_to_the_intact_older_one(tmp_path, damage):
    _save(tmp_path, 2)
    latest = _save(tmp_path, 4)
    damage(latest)
    state, lines = _load(tmp_path)
    assert state["next_step"] == 2 and torch.equal(state["trainer"]["model"]["w"], _state(2.0)["model"]["w"])
    assert len(lines) == 1 and "step_000004.pt" in lines[0] and "damaged" in lines[0]


@pytest.mark.parametrize("damage", [_flip, _truncate])
def test_damaged_latest_without_an_intact_one_is_one_clear_error(tmp_path, damage):
    damage(_save(tmp_path, 4))
    with pytest.raises(DriverCheckpointError) as info:
        _load(tmp_path)
    text = str(info.value)
    assert "step_000004.pt" in text and "\n" not in text and "--qrl-output-dir" in text


def test_a_checkpoint_without_its_checksum_is_not_trusted(tmp_path):
    _save(tmp_path, 2)
    latest = _save(tmp_path, 4)
    latest.with_name(latest.name + ".sha256").unlink()
    state, lines = _load(tmp_path)
    assert state["next_step"] == 2 and "no checksum file" in lines[0]


def test_the_checksum_file_is_sha256sum_format(tmp_path):
    import hashlib

    path = _save(tmp_path, 3)
    digest, name = path.with_name(path.name + ".sha256").read_text().split()
    assert name == path.name and digest == hashlib.sha256(path.read_bytes()).hexdigest()


def test_older_checkpoints_survive_until_a_newer_verified_one_exists(tmp_path):
    _save(tmp_path, 2)
    damaged = _save(tmp_path, 4)
    _flip(damaged)
    assert _load(tmp_path)[0]["next_step"] == 2  # the resumed run continues from step 2
    _save(tmp_path, 3)  # its first save: the damaged step 4 is set aside, step 2 is kept
    assert _names(tmp_path) == ["step_000002.pt", "step_000002.pt.sha256", "step_000003.pt",
                                "step_000003.pt.sha256", "step_000004.pt.damaged",
                                "step_000004.pt.damaged.sha256"]
    assert _load(tmp_path)[0]["next_step"] == 3
    _save(tmp_path, 4)
    assert [n for n in _names(tmp_path) if n.endswith(".pt")] == ["step_000003.pt", "step_000004.pt"]


def test_a_failed_save_prunes_nothing_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    _save(tmp_path, 2)
    _save(tmp_path, 4)

    def disk_full(obj, fh, *a, **k):
        fh.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError):
        _save(tmp_path, 6)
    assert _names(tmp_path) == ["step_000002.pt", "step_000002.pt.sha256", "step_000004.pt",
                                "step_000004.pt.sha256"]


def test_a_save_whose_bytes_read_back_differ_prunes_nothing(tmp_path, monkeypatch):
    import megatron_qrl.rl.checkpoint as ck

    _save(tmp_path, 2)
    _save(tmp_path, 4)
    real, calls = ck._sha256, []

    def flaky(path):  # the second hash (read back from disk) differs
        calls.append(path)
        return real(path) if len(calls) == 1 else "0" * 64

    monkeypatch.setattr(ck, "_sha256", flaky)
    with pytest.raises(OSError, match="read back differ"):
        _save(tmp_path, 6)
    monkeypatch.setattr(ck, "_sha256", real)
    assert {"step_000002.pt", "step_000004.pt"} <= set(_names(tmp_path))


# --- checkpoints: identity ---------------------------------------------------------------

def test_resume_with_another_model_shape_names_the_megatron_flag(tmp_path):
    _save(tmp_path, 2)
    with pytest.raises(QrlArgumentError) as info:
        load_driver_checkpoint(tmp_path, FLAGS, {**MODEL, "num_experts_per_tok": 3})
    assert "--moe-router-topk 2 -> 3" in str(info.value)


def test_resume_with_other_flags_names_every_differing_flag(tmp_path):
    _save(tmp_path, 2)
    flags = {**FLAGS, "qrl_lr": 2e-3, "qrl_seed": 8, "qrl_steps": 9}  # steps may change
    with pytest.raises(QrlArgumentError) as info:
        load_driver_checkpoint(tmp_path, flags, {**MODEL, "hidden_size": 64})
    text = str(info.value)
    assert "--qrl-lr" in text and "--qrl-seed" in text and "--hidden-size 32 -> 64" in text
    assert "--qrl-steps" not in text


# --- output directory ----------------------------------------------------------------------

def test_a_used_output_directory_is_refused_without_resume(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text('{"step": 0}\n')
    _save(tmp_path / "b", 2)  # checkpoints but metrics.jsonl removed
    for d in ("a", "b"):
        with pytest.raises(FileExistsError, match="--qrl-resume"):
            prepare_output_dir(tmp_path / d, resume=False)
    assert prepare_output_dir(tmp_path / "new", resume=False) is False
    assert prepare_output_dir(tmp_path / "b", resume=True) is True


def test_resume_before_the_first_checkpoint_starts_again(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')  # what a crash at step 1 leaves
    assert prepare_output_dir(tmp_path, resume=True) is False
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prepare_output_dir(tmp_path / "typo", resume=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        prepare_output_dir(tmp_path / "file", resume=False)


def test_stale_temporary_files_are_removed_at_start(tmp_path):
    ck = tmp_path / CKPT_DIR
    _save(tmp_path, 2)
    stale = [ck / ".step_000004.pt.tmp-123", ck / "step_000004.pt.sha256",
             tmp_path / ".metrics.jsonl.tmp-abc"]
    for p in stale:
        p.write_text("x")
    (tmp_path / ".sync.old-xyz").mkdir()
    prepare_output_dir(tmp_path, resume=True)
    assert not any(p.exists() for p in stale) and not (tmp_path / ".sync.old-xyz").exists()
    assert _names(tmp_path) == ["step_000002.pt", "step_000002.pt.sha256"]


# --- NaN guard --------------------------------------------------------------------------

def test_guard_counts_skips_and_stops_past_the_limit():
    from megatron_qrl.rl.guard import BadStepGuard, BadStepsError, non_finite_loss

    lines: list[str] = []
    guard = BadStepGuard(1, lines.append)
    guard.begin(5)
    guard.skip("grad_norm", float("nan"))
    guard.skip("grad_norm", float("nan"))  # a second update of the same step
    rec = guard.record({"step": 5, "grad_norm": float("nan"), "reward_mean": 0.5})
    assert rec == {"step": 5, "grad_norm": None, "reward_mean": 0.5, "bad_updates": 2,
                   "bad_steps_total": 1}
    assert len(lines) == 1 and "step 5: grad_norm is nan" in lines[0]
    guard.begin(6)
    with pytest.raises(BadStepsError, match=r"step 6: loss is inf.*--qrl-max-bad-steps 1"):
        guard.skip("loss", float("inf"))
    assert non_finite_loss([{"loss": torch.tensor(1.0)}, {"sft_loss": torch.tensor(float("nan"))}]
                           )[0] == "sft_loss"
    assert non_finite_loss([{"loss": torch.tensor(1.0), "ratio_max": float("inf")}]) is None


# --- one-line errors ------------------------------------------------------------------------

class SafetensorError(Exception):  # the name safetensors' own error class has
    pass


@pytest.mark.parametrize("exc, needle, code", [
    (OSError(errno.ENOSPC, "No space left on device", "/out/ckpt.pt"),
     "/out/ckpt.pt: No space left on device (the file system is full", 2),
    (OSError(errno.EROFS, "Read-only file system", "/out"), "read-only", 2),
    (SafetensorError("Error while deserializing header: MetadataIncompleteBuffer"),
     "--qrl-checkpoint /ckpt: a weight file is damaged or truncated", 2),
])
def test_error_line_of_disk_and_shard_failures(exc, needle, code):
    from megatron_qrl.config.run import RunConfig
    from megatron_qrl.rl.cli import error_line

    run = RunConfig(model="checkpoint", checkpoint="/ckpt", output_dir="/out")
    line, rc = error_line(exc, run)
    assert needle in line and "\n" not in line and rc == code


def test_error_line_of_model_errors_bad_steps_and_bugs():
    from megatron_qrl.config.run import RunConfig
    from megatron_qrl.models.hf_config import UnsupportedModelError
    from megatron_qrl.models.hf_io import CheckpointMismatchError
    from megatron_qrl.rl.cli import error_line
    from megatron_qrl.rl.guard import BadStepsError

    run = RunConfig(model="checkpoint", checkpoint="/ckpt")
    assert error_line(CheckpointMismatchError("/ckpt/a.safetensors: tensor x has shape"), run) \
        == ("--qrl-checkpoint /ckpt: /ckpt/a.safetensors: tensor x has shape", 2)
    assert error_line(UnsupportedModelError("config.json: hidden_act='gelu'"), run)[0] \
        .startswith("--qrl-checkpoint /ckpt: config.json")
    assert error_line(BadStepsError("step 3: grad_norm is nan"), run) == \
        ("step 3: grad_norm is nan", 1)
    assert error_line(RuntimeError("a bug"), run) == (None, 1)


def test_malformed_prompt_files_name_file_and_line(tmp_path):
    from megatron_qrl.data.dataset import PromptFileError, load_prompt_jsonl

    cases = {"json": b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", \n',
             "utf8": b'{"prompt": "1+1=", "answer": "2"}\n\xff\xfe\n',
             "nan": b'{"prompt": "1+1=", "answer": NaN}\n'}
    for name, data in cases.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(data)
        with pytest.raises(PromptFileError) as info:
            load_prompt_jsonl(path)
        line = 1 if name == "nan" else 2
        assert f"{path}, line {line}" in str(info.value) and "--qrl-task-prompts" in str(info.value)


# --- end to end (tiny CPU model, engine double) ------------------------------------------------

TINY = ["--qrl-preset", "tiny-cpu", "--qrl-sft-steps", "1", "--qrl-prompts-per-step", "2",
        "--qrl-rollout-n-samples-per-prompt", "4", "--qrl-rollout-max-new-tokens", "4",
        "--qrl-micro-batch-size", "4", "--qrl-updates-per-step", "2", "--qrl-save-interval", "1",
        "--qrl-lr", "1e-3", "--qrl-no-progress", "--qrl-steps", "1"]


def _qrl(out: Path, *extra: str, helper: str = "rl_run_helper.py",
         pre: tuple[str, ...] = ("--double",)) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("QRL_DEBUG", None)
    return subprocess.run([sys.executable, str(HELPERS / helper), *pre, *TINY,
                           "--qrl-output-dir", str(out), *extra],
                          capture_output=True, text=True, timeout=600, env=env)


def _one_line_error(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("qrl-train: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


@pytest.mark.slow
def test_resume_paths_end_to_end(tmp_path):
    out = tmp_path / "run"
    (out / CKPT_DIR).mkdir(parents=True)  # a run that crashed before its first checkpoint
    (out / "metrics.jsonl").write_text(json.dumps({"step": 0, "phase": "sft"}) + "\n")
    (out / CKPT_DIR / ".step_000001.pt.tmp-99").write_bytes(b"half a checkpoint")
    first = _qrl(out, "--qrl-resume")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "starting the run at step 0" in first.stdout
    assert _names(out) == ["step_000001.pt", "step_000001.pt.sha256", "step_000002.pt",
                           "step_000002.pt.sha256"]
    assert [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()] \
        == [0, 1]

    _flip(out / CKPT_DIR / "step_000002.pt")  # bit flips in the latest: resume from step 1
    second = _qrl(out, "--qrl-resume", "--qrl-steps", "2")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "step_000002.pt skipped: damaged" in second.stdout
    assert "resumed from step 1" in second.stdout
    assert [n for n in _names(out) if n.endswith(".pt")] == ["step_000002.pt", "step_000003.pt"]

    line = _one_line_error(_qrl(out, "--qrl-resume", "--", "--moe-router-topk", "3"))
    assert "--moe-router-topk 2 -> 3" in line

    (out / "metrics.jsonl").unlink()
    line = _one_line_error(_qrl(out))
    assert "holds a run" in line and "--qrl-resume" in line


@pytest.mark.slow
def test_nan_gradient_skips_counts_and_stops_before_broken_weights_reach_the_engine(tmp_path):
    out, marker = tmp_path / "run", tmp_path / "non-finite-sync"
    proc = _qrl(out, "--qrl-steps", "4", "--qrl-max-bad-steps", "2", helper="rl_nan_helper.py",
                pre=(str(marker),))
    line = _one_line_error(proc, code=1)
    assert "step 3: grad_norm is nan" in line and "--qrl-max-bad-steps 2" in line
    assert not marker.exists(), marker.read_text()
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["bad_updates"], r["bad_steps_total"]) for r in recs] == \
        [(0, 0, 0), (1, 2, 1), (2, 2, 2)]
    assert recs[1]["grad_norm"] is None and recs[0]["grad_norm"] > 0
    state = torch.load(out / CKPT_DIR / "step_000003.pt", weights_only=False)
    assert all(torch.isfinite(t).all() for t in state["trainer"]["model"].values()
               if t.is_floating_point())


@pytest.mark.slow
def test_malformed_prompts_one_line_and_debug_traceback(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "answer": "2"}\n{oops\n')
    line = _one_line_error(_qrl(tmp_path / "a", "--qrl-task-prompts", str(prompts)))
    assert f"{prompts}, line 2: invalid JSON" in line
    debug = _qrl(tmp_path / "b", "--qrl-task-prompts", str(prompts), "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr


@pytest.mark.slow
def test_truncated_start_checkpoint_shard_is_one_line(tmp_path):
    from megatron_qrl.data import CharTokenizer
    from tests.helpers.tiny_hf import make_tiny_hf

    hf = make_tiny_hf(tmp_path / "hf", "moe")
    CharTokenizer().save(hf, hf=False)
    shard = hf / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    line = _one_line_error(_qrl(tmp_path / "run", "--qrl-model", "checkpoint",
                                "--qrl-checkpoint", str(hf)))
    assert f"--qrl-checkpoint {hf}" in line and "model.safetensors" in line


@pytest.mark.slow
def test_truncated_distcp_shard_of_a_megatron_start_checkpoint_is_one_line(tmp_path):
    from megatron_qrl.data import CharTokenizer
    from tests.helpers.tiny_hf import make_tiny_hf

    hf = make_tiny_hf(tmp_path / "hf", "moe")
    CharTokenizer().save(hf, hf=True)  # travels into ckpt/hf/
    ckpt = tmp_path / "ckpt"
    conv = subprocess.run([sys.executable, str(REPO / "tools" / "convert_hf_to_megatron.py"),
                           "--hf-dir", str(hf), "--out", str(ckpt)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=REPO)
    assert conv.returncode == 0, conv.stderr[-3000:]
    shards = sorted(ckpt.rglob("*.distcp"))
    assert shards
    _truncate(shards[0])
    line = _one_line_error(_qrl(tmp_path / "run", "--qrl-model", "checkpoint",
                                "--qrl-checkpoint", str(ckpt)))
    assert f"--qrl-checkpoint {ckpt}" in line and "truncated" in line and ".distcp" in line


def test_resume_ignores_where_pi_prox_is_computed():
    """A run saved when --qrl-prox-from-first-update defaulted to off resumes under the new
    auto default (same pi_prox values); a real change (the loss) is still named."""
    from megatron_qrl.rl.checkpoint import _identity_diffs

    state = {"flags": {"qrl_prox_from_first_update": False, "qrl_loss_kind": "tis"}}
    assert _identity_diffs(state, {"qrl_prox_from_first_update": None,
                                   "qrl_loss_kind": "tis"}, None) == []
    assert _identity_diffs(state, {"qrl_prox_from_first_update": None,
                                   "qrl_loss_kind": "ppo_clip"}, None) == [
        "--qrl-loss-kind 'tis' -> 'ppo_clip'"]


def test_what_may_change_on_resume_is_declared_on_the_config_fields():
    """The flags a resumed run may change are the config fields marked
    ``{"on_resume": "may change"}`` (every group's, nested SGLang options included); a field
    without the mark is compared. Fails when the generator drops the mark (every flag would
    then be compared: ``--qrl-steps`` named below)."""
    from megatron_qrl.rl.checkpoint import _identity_diffs, resume_keys_ignored

    ignored = resume_keys_ignored()
    for dest in ("qrl_steps", "qrl_output_dir", "qrl_rollout_sglang_stack_experts",
                 "qrl_launch_collective_timeout_s", "qrl_train_moe_fast_path"):
        assert dest in ignored, dest
    assert not {"qrl_loss_kind", "qrl_rollout_format", "qrl_seed", "qrl_lr"} & ignored
    state = {"flags": {"qrl_steps": 4, "qrl_rollout_sglang_stack_experts": None,
                       "qrl_rollout_format": "int8"}}
    assert _identity_diffs(state, {"qrl_steps": 8, "qrl_rollout_sglang_stack_experts": True,
                                   "qrl_rollout_format": "fp8"}, None) == [
        "--qrl-rollout-format 'int8' -> 'fp8'"]
