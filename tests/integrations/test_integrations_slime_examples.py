"""The slime launch scripts in examples/slime/: their megatron_qrl flag block parses with
add_qrl_args and passes the options' checks against the slime flags beside it, every dotted
path names a function here, and the scripts are valid bash. slime is found as in
test_integrations_slime.py; without it these tests skip with the reason."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.integrations.test_integrations_slime import SKIP, slime_args

pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "slime"


def bash_array(text: str, name: str, subst: dict[str, str]) -> list[str]:
    """The tokens of the bash array ``name=( ... )`` in ``text`` (comments dropped, ``${VAR}``
    replaced from ``subst``, e.g. what the script's defaults give)."""
    block = text.split(f"{name}=(", 1)[1].split("\n)", 1)[0]
    tokens = shlex.split("\n".join(line.split("#")[0] for line in block.splitlines()))
    for var, value in subst.items():
        tokens = [t.replace("${" + var + "}", value) for t in tokens]
    return tokens


def block_options(tokens: list[str], **slime_kw):
    """The validated qrl options of ``tokens`` (qrl flags + slime flags) over slime's defaults."""
    from megatron_qrl.config import add_qrl_args
    from megatron_qrl.integrations.slime.options import slime_options

    args, rest = add_qrl_args(argparse.ArgumentParser()).parse_known_args(tokens)
    i = 0
    while i < len(rest):  # slime's flags: a flag with its values (several for --spec)
        values = []
        while i + 1 + len(values) < len(rest) and not rest[i + 1 + len(values)].startswith("--"):
            values.append(rest[i + 1 + len(values)])
        dest = rest[i][2:].replace("-", "_")
        setattr(args, dest, True if not values else values[0] if len(values) == 1 else values)
        i += 1 + len(values)
    for key, value in vars(slime_args(**slime_kw)).items():
        if not key.startswith("qrl_") and not hasattr(args, key):
            setattr(args, key, value)
    return slime_options(args)


def dotted_paths_resolve(text: str) -> set[str]:
    paths = set(re.findall(r"megatron_qrl\.integrations\.slime\.[\w.]+", text)) - {
        "megatron_qrl.integrations.slime.launch", "megatron_qrl.integrations.slime.model"}
    for path in paths:
        module, name = path.rsplit(".", 1)
        assert callable(getattr(importlib.import_module(module), name)), path
    return paths


def test_30b_example_qrl_block_is_valid():
    """examples/slime/run_qwen3_30b_a3b_qrl.sh (8 GPUs, fp8_block, ACR, R3, error tokens)."""
    text = (EXAMPLES / "run_qwen3_30b_a3b_qrl.sh").read_text()
    opts = block_options(bash_array(text, "QRL_ARGS", {"FORMAT": "fp8_block"}))
    assert (opts.loss.kind, opts.rollout.format, opts.routing.replay) == ("acr", "fp8_block", "all")
    assert len(dotted_paths_resolve(text)) == 5


@pytest.mark.parametrize("loss", ["acr", "tbpo"])
def test_1gpu_example_qrl_block_is_valid(tmp_path, loss):
    """examples/slime/run_qwen3_4b_qrl_1gpu.sh, QRL=1: fp8_block, the aligned forward through
    --spec, the loss kind, error tokens and AQN, with every hook the options need named (the
    arguments the script passes, run with ``python3`` / ``ray`` stood in)."""
    from megatron_qrl.integrations.slime.options import SPEC
    from tests.helpers.slime_walk import run_example

    text = (EXAMPLES / "run_qwen3_4b_qrl_1gpu.sh").read_text()
    argv, _ = run_example(tmp_path, CKPT="/ckpt", LOSS=loss, QRL="1")
    tokens = argv[argv.index("--hf-checkpoint", argv.index("--seed")):]
    opts = block_options(tokens, custom_megatron_init_path=None, spec=None)
    assert (opts.loss.kind, opts.rollout.format, opts.train.forward) == (loss, "fp8_block", "aligned")
    assert opts.aqn.enabled and opts.error_tokens.action == "mask"
    assert tokens[tokens.index("--spec") + 1:tokens.index("--spec") + 3] == SPEC
    assert tokens[:2] == ["--hf-checkpoint", "/ckpt-fp8_block"]
    assert len(dotted_paths_resolve(text)) == 6  # loss, 4 hooks, the reward (--spec: SPEC)
    rollout = bash_array(text, "ROLLOUT_ARGS", {"CKPT": "/ckpt", "ROLLOUTS": "3"})
    assert rollout[rollout.index("--label-key") + 1] == "answer"  # the prompts file's column


def test_1gpu_example_mismatch_diagnostics(tmp_path):
    """AQN=0 drops AQN, TRAIN_FORWARD=bf16 the aligned forward and its --spec; the rest of the
    QRL=1 run stays (the diagnostic runs of docs/SLIME.md)."""
    from tests.helpers.slime_walk import run_example

    argv, _ = run_example(tmp_path, CKPT="/ckpt", QRL="1", AQN="0", TRAIN_FORWARD="bf16")
    tokens = argv[argv.index("--hf-checkpoint", argv.index("--seed")):]
    opts = block_options(tokens, custom_megatron_init_path=None, spec=None)
    assert (opts.rollout.format, opts.train.forward, opts.aqn.enabled) == ("fp8_block", "bf16", False)
    assert "--spec" not in tokens and "--qrl-aqn-enabled" not in tokens
    assert opts.loss.kind == "acr" and opts.error_tokens.action == "mask"


def test_1gpu_example_baseline_has_no_qrl_flags():
    """QRL=0 is slime unchanged: none of our flags or hooks but the shared reward; no flag
    slime's or Megatron's argument checks refuse without its partner."""
    text = (EXAMPLES / "run_qwen3_4b_qrl_1gpu.sh").read_text()
    base = bash_array(text, "BASELINE_ARGS", {})
    assert not [t for t in base if t.startswith("--qrl") or "megatron_qrl" in t]
    # found on the H200: slime 0.3.1 asserts a --custom-tis-function-path with
    # --get-mismatch-metrics, and Megatron a --save-interval with --save
    assert "--get-mismatch-metrics" not in base or "--custom-tis-function-path" in base
    assert "--save" not in bash_array(text, "CKPT_ARGS", {"CKPT": "/ckpt"})
    assert '--save "${SAVE}" --save-interval' in text
    for script in EXAMPLES.glob("*.sh"):
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, (script, proc.stderr)


@pytest.mark.parametrize("apex", [False, True])
def test_1gpu_example_turns_off_gradient_accumulation_fusion_without_apex(tmp_path, apex):
    """Megatron refuses `gradient_accumulation_fusion` (its default) without apex's CUDA
    extension, as slime's Megatron did on the H200 image; with apex the fusion stays on."""
    text = (EXAMPLES / "run_qwen3_4b_qrl_1gpu.sh").read_text()
    start = text.index("PERF_ARGS=(")
    end = text.index("\n", text.index("|| PERF_ARGS+=", start))
    if apex:
        (tmp_path / "fused_weight_gradient_mlp_cuda.py").write_text("")
    script = text[start:end] + '\nprintf "%s\\n" "${PERF_ARGS[@]}"\n'
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert ("--no-gradient-accumulation-fusion" in r.stdout.split()) == (not apex)


def test_1gpu_example_fp8_block_engines_skip_deepgemm_jit(tmp_path):
    """QRL=1 (fp8_block rollouts) exports SGLANG_ENABLE_JIT_DEEPGEMM=0 before its Ray head
    unless the caller set it; QRL=0 leaves the environment as it was."""
    from tests.helpers.slime_walk import run_example

    env = {k: v for k, v in os.environ.items() if k != "SGLANG_ENABLE_JIT_DEEPGEMM"}
    cases = [("1", None, "0"), ("1", "1", "1"), ("0", None, None)]
    for qrl, given, want in cases:
        base = dict(env, **({"SGLANG_ENABLE_JIT_DEEPGEMM": given} if given else {}))
        argv, ran = run_example(tmp_path, base, CKPT="/ckpt", QRL=qrl)
        assert ran.get("SGLANG_ENABLE_JIT_DEEPGEMM") == want, (qrl, given)
        assert ("train.py" in argv) == (qrl == "0")
