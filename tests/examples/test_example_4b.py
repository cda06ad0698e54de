"""examples/run_qwen3_4b_1gpu.sh: the flags it passes fit one H200 beside SGLang (CPU check)."""

from __future__ import annotations

import pytest

from megatron_qrl.config import add_qrl_args, effective_values
from megatron_qrl.config.megatron_flags import parse_megatron_flags
from tests.examples.test_rl_examples import EXAMPLES, _captured_args

SCRIPT = EXAMPLES / "run_qwen3_4b_1gpu.sh"


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    return argv[: argv.index("--")], argv[argv.index("--") + 1:]


def test_defaults_single_mode_release_recompute(tmp_path):
    import argparse

    argv = _captured_args(tmp_path, SCRIPT, {"CKPT": str(tmp_path)})
    qrl, megatron = _split(argv)
    assert qrl[:2] == ["--qrl-mode", "single"]
    # every --qrl-* flag exists (the full checks need a GPU: SGLang); values after the preset
    parser = add_qrl_args(argparse.ArgumentParser(allow_abbrev=False))
    v = effective_values(parser.parse_args(qrl[2:]))
    got = tuple(v["qrl_" + k] for k in ("rollout_engine", "rollout_format",
                                         "rollout_sglang_mem_fraction", "rollout_max_new_tokens",
                                         "micro_batch_size", "rollout_sglang_release_memory"))
    assert got == ("sglang", "fp8", 0.3, 1024, 4, True)
    settings, _, _ = parse_megatron_flags(megatron)
    assert "recompute_granularity" not in dict(settings.config_overrides)  # TE + release: none
    assert settings.bf16 and settings.transformer_impl == "auto"


def test_knobs(tmp_path):
    argv = _captured_args(tmp_path, SCRIPT, {
        "CKPT": str(tmp_path), "STEPS": "3", "SAVE_INTERVAL": "-1", "RECOMPUTE": "1",
        "OFFLOAD": "1", "TIMPL": "local", "MEM_FRACTION": "0.25", "MODE": "colocated",
        "RELEASE": "0"})
    qrl, megatron = _split(argv)
    assert qrl[:2] == ["--qrl-mode", "colocated"]
    for flag, value in (("--qrl-steps", "3"), ("--qrl-save-interval", "-1"),
                        ("--qrl-rollout-sglang-mem-fraction", "0.25")):
        assert qrl[qrl.index(flag) + 1] == value
    assert megatron[megatron.index("--recompute-granularity") + 1] == "full"
    assert "--no-qrl-rollout-sglang-release-memory" in qrl
    assert {"--use-distributed-optimizer", "--optimizer-cpu-offload"} <= set(megatron)
    assert megatron[megatron.index("--transformer-impl") + 1] == "local"
    with pytest.raises(Exception, match="CUDA|GPU"):  # offload needs a GPU (CPU host here)
        parse_megatron_flags(megatron)


@pytest.mark.parametrize("env,sleep,fraction", [
    ({}, "off", "0.3"),
    ({"SLEEP": "on"}, "on", "0.6"),
    ({"SLEEP": "on", "MEM_FRACTION": "0.5"}, "on", "0.5"),
    ({"SLEEP": "off", "MEM_FRACTION": "0.4"}, "off", "0.4"),
])
def test_sleep_knob_sets_the_flag_and_the_engine_fraction(tmp_path, env, sleep, fraction):
    """SLEEP=on puts the trainer to sleep during rollout and gives the engine 0.6 of the GPU
    (MEM_FRACTION still wins); the default keeps the preset's resident trainer at 0.3."""
    qrl, _ = _split(_captured_args(tmp_path, SCRIPT, {"CKPT": str(tmp_path), **env}))
    assert qrl[qrl.index("--qrl-trainer-sleep") + 1] == sleep
    assert qrl[qrl.index("--qrl-rollout-sglang-mem-fraction") + 1] == fraction


def test_sync_knob_passes_the_sync_path_and_the_defaults_keep_the_preset(tmp_path):
    """SYNC=direct passes --qrl-rollout-sglang-sync direct with the memory saver on (the
    engine writes); unset passes nothing (the preset's choice)."""
    import argparse

    qrl, _ = _split(_captured_args(tmp_path, SCRIPT, {"CKPT": str(tmp_path), "SYNC": "direct"}))
    assert qrl[qrl.index("--qrl-rollout-sglang-sync") + 1] == "direct"
    v = effective_values(add_qrl_args(argparse.ArgumentParser(allow_abbrev=False)).parse_args(
        qrl[2:]))
    assert v["qrl_rollout_sglang_sync"] == "direct" and v["qrl_rollout_sglang_release_memory"]
    plain, _ = _split(_captured_args(tmp_path, SCRIPT, {"CKPT": str(tmp_path)}))
    assert "--qrl-rollout-sglang-sync" not in plain
