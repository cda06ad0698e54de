"""examples/: the launch scripts parse, source their model shapes and pass valid flags."""

import os
import subprocess
from pathlib import Path

import pytest

from megatron_qrl.rl.cli import parse_configs

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPTS = sorted(EXAMPLES.glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_syntax_and_model_shape(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert 'source "${HERE}/models/' in script.read_text()


def _captured_args(tmp_path, script, env=None):
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "qrl-train").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    (fake / "qrl-train").chmod(0o755)
    (fake / "ray").write_text("#!/usr/bin/env bash\nexit 0\n")
    (fake / "ray").chmod(0o755)
    # torchrun: print what follows `-m megatron_qrl.rl.cli` (the qrl-train arguments)
    (fake / "torchrun").write_text(
        '#!/usr/bin/env bash\nwhile [ "$#" -gt 0 ] && [ "$1" != "megatron_qrl.rl.cli" ]; do '
        'shift; done\n[ "$#" -gt 0 ] || { echo "torchrun without -m megatron_qrl.rl.cli" >&2; '
        'exit 3; }\nshift\nprintf "%s\\n" "$@"\n')
    (fake / "torchrun").chmod(0o755)
    # a user's shell, not this worker's: a Ray started in-process (the shared test cluster)
    # leaves RAY_* variables (RAY_AUTH_MODE=token) that the scripts read
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    run_env = dict(clean, PATH=f"{fake}:{os.environ['PATH']}", **(env or {}))
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=run_env,
                         timeout=60)
    assert out.returncode == 0, f"{script.name} exited {out.returncode}: {out.stderr[-3000:]}"
    return out.stdout.splitlines()


def test_tiny_cpu_script_runs_the_default_job(tmp_path):
    argv = _captured_args(tmp_path, EXAMPLES / "run_tiny_cpu.sh", {"SEED": "7"})
    configs, flags, _ = parse_configs(argv)
    assert flags["qrl_preset"] == "tiny-cpu" and configs["run"].seed == 7
    assert configs["run"].resolved_output_dir() == "qrl_runs/tiny-cpu-seed7"


def test_multinode_script_layout(tmp_path):
    argv = _captured_args(tmp_path, EXAMPLES / "run_qwen3_30b_a3b.sh",
                          {"CKPT": str(tmp_path), "VARIANT": "nvfp4", "HEAD_ADDR": "10.0.0.1"})
    qrl, megatron = argv[: argv.index("--")], argv[argv.index("--") + 1:]
    assert qrl[:2] == ["--qrl-mode", "disaggregated"]
    assert "qwen3-30b-a3b,qerl" in qrl
    for flag, value in (("--tensor-model-parallel-size", "2"),
                        ("--expert-model-parallel-size", "8"), ("--num-experts", "128")):
        assert megatron[megatron.index(flag) + 1] == value


def test_multinode_script_sizes_the_fleet(tmp_path):
    """ENGINES x ENGINE_TP / ENGINE_EP / DP_ATTENTION become the fleet flags (and a layout
    the checks accept for Qwen3-30B-A3B's 32 heads, 4 KV heads, 128 experts)."""
    from megatron_qrl.config.run import RolloutConfig
    from megatron_qrl.rollout.fleet_layout import engine_parallel, fleet_layout

    argv = _captured_args(tmp_path, EXAMPLES / "run_qwen3_30b_a3b.sh",
                          {"CKPT": str(tmp_path), "ENGINES": "1", "ENGINE_TP": "8",
                           "HEAD_ADDR": "10.0.0.1", "ENGINE_EP": "8", "DP_ATTENTION": "1", "MODE": "colocated"})
    qrl = argv[: argv.index("--")]

    def value(flag):
        return qrl[qrl.index(flag) + 1]

    assert (value("--qrl-mode"), value("--qrl-rollout-num-engines"),
            value("--qrl-rollout-engine-tp"), value("--qrl-rollout-engine-ep"),
            value("--qrl-rollout-sglang-mem-fraction")) == ("colocated", "1", "8", "8", "0.4")
    assert "--qrl-rollout-engine-dp-attention" in qrl
    RolloutConfig(engine="sglang", num_engines=1, engine_tp=8, engine_ep=8,
                  engine_dp_attention=True)
    fleet_layout(1, 8, 8, "sglang", "colocated", trainer_gpus=8, mem_fraction=0.4)
    engine_parallel({"num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128,
                     "moe_intermediate_size": 768}, 8, 8, dp_attention=True)
    plain = _captured_args(tmp_path, EXAMPLES / "run_qwen3_30b_a3b.sh",
                           {"CKPT": str(tmp_path), "HEAD_ADDR": "10.0.0.1"})
    assert "--qrl-rollout-engine-dp-attention" not in plain
    assert plain[plain.index("--qrl-rollout-num-engines") + 1] == "8"
