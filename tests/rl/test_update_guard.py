"""The guard guards: an update that leaves exploding weights is undone, and the weight sync
refuses NaN / inf weights before the engine sees them.

``--qrl-lr 1e30`` (finite gradients; Adam's first step is ``lr * sign(g)``): each RL update is
undone (parameters and optimizer state back to before it), counted as a bad step, and the
checkpoint after the step holds the weights from before it; the engine's weights stay finite
and small. A NaN weight (here in the start weights) stops the run at the first sync with ONE
error naming the parameter, and the engine never receives an update.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_qrl.rl.sync import NonFiniteWeightsError, refuse_non_finite

RUN = ["--qrl-preset", "tiny-cpu", "--qrl-sft-steps", "1", "--qrl-prompts-per-step", "2",
       "--qrl-rollout-n-samples-per-prompt", "4", "--qrl-rollout-max-new-tokens", "4",
       "--qrl-micro-batch-size", "8", "--qrl-updates-per-step", "1", "--qrl-no-progress",
       "--no-qrl-tensorboard", "--qrl-save-interval", "1"]


def _run(tmp_path, *extra, start_weights=None):
    from megatron_qrl.models.runtime import single_process_megatron
    from megatron_qrl.rl.cli import parse_configs
    from megatron_qrl.rl.driver import run_job
    from megatron_qrl.rl.sync import make_engine

    engines = []

    def factory(*a, **kw):
        engines.append(make_engine(*a, **kw))
        return engines[-1]

    configs, flags, _ = parse_configs([*RUN, "--qrl-output-dir", str(tmp_path / "run"), *extra])
    said: list[str] = []
    with single_process_megatron():
        try:
            recs = run_job(configs, flags, engine_factory=factory, progress=False,
                           log=said.append, start_weights=start_weights)
        except NonFiniteWeightsError as exc:
            return exc, engines, said
    return recs, engines, said


def _model(tmp_path, step: int) -> dict:
    state = torch.load(tmp_path / "run" / "checkpoints" / f"step_{step:06d}.pt",
                       weights_only=False)
    return {k: v for k, v in state["trainer"]["model"].items()
            if torch.is_tensor(v) and v.is_floating_point()}


@pytest.mark.slow
def test_an_exploding_update_is_undone_and_never_reaches_the_engine(tmp_path):
    recs, (engine,), said = _run(tmp_path, "--qrl-lr", "1e30", "--qrl-steps", "2",
                                 "--qrl-max-bad-steps", "5")
    rl = [r for r in recs if r["phase"] == "rl"]
    assert [r["bad_updates"] for r in rl] == [1, 1] and rl[-1]["bad_steps_total"] == 2
    assert any("update norm / weight norm" in m and "skipped" in m for m in said)
    first, second = _model(tmp_path, 2), _model(tmp_path, 3)  # after each RL step
    assert max(float(t.abs().max()) for t in first.values()) < 1e3
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)  # undone: nothing moved
    held = max(float(p.abs().max()) for p in engine.model.parameters())
    assert math.isfinite(held) and held < 1e3


def test_refuse_non_finite_names_the_parameter():
    ok = [("a", torch.ones(3)), ("b", torch.zeros(2))]
    refuse_non_finite(ok, version=1)
    with pytest.raises(NonFiniteWeightsError, match="version 4 refused: .*parameter b "):
        refuse_non_finite([("a", torch.ones(3)), ("b", torch.tensor([1.0, math.inf]))], 4)


def test_the_first_non_finite_parameter_in_order_across_dtypes():
    """NaN and inf found in BF16 and fp32 parameters alike, the first in the given order named;
    empty and integer tensors are finite. Mutation caught: the last bad parameter named
    instead of the first."""
    from megatron_qrl.rl.sync import first_non_finite

    big = torch.ones(1000, dtype=torch.bfloat16)
    params = [("e", torch.empty(0)), ("i", torch.zeros(3, dtype=torch.int32)),
              ("a", torch.ones(4)), ("b", big.clone()), ("c", torch.tensor([1.0, math.nan])),
              ("d", big.clone())]
    assert first_non_finite(params) == "c"
    params[5][1][7] = -math.inf
    assert first_non_finite(params) == "c"
    params[4][1][1] = 0.0
    assert first_non_finite(params) == "d"
    params[3][1][999] = math.nan
    assert first_non_finite(params) == "b"
    assert first_non_finite(params[:3]) is None


@pytest.mark.slow
def test_the_sync_refuses_nan_weights_and_leaves_the_engine_untouched(tmp_path):
    from megatron_qrl.rl.cli import error_line, parse_configs
    from megatron_qrl.rl.driver import prepare_job

    configs = parse_configs([*RUN, "--qrl-output-dir", str(tmp_path / "x")])[0]
    cfg = prepare_job(configs).hf_config
    nan = torch.full((cfg["vocab_size"], cfg["hidden_size"]), math.nan)
    exc, (engine,), _ = _run(tmp_path, "--qrl-sft-steps", "0", "--qrl-steps", "1",
                             start_weights={"embedding.word_embeddings.weight": nan})
    assert isinstance(exc, NonFiniteWeightsError), exc
    assert "embedding.word_embeddings.weight" in str(exc)
    assert engine.weight_version() < 0  # never updated
    line, code = error_line(exc, configs["run"])
    assert code == 1 and "\n" not in line and "NaN" in line


def test_the_pre_step_copy_is_on_in_the_cpu_preset_only():
    """The guard's copy doubles the parameters and optimizer state on their device (a 4B
    trainer's ~56 GB would not fit beside the engine on one H200): off by default, on in the
    CPU job's preset."""
    import dataclasses

    from megatron_qrl.config.presets import PRESETS
    from megatron_qrl.config.run import RunConfig

    default = {f.name: f.default for f in dataclasses.fields(RunConfig)}["max_update_ratio"]
    assert default == 0.0
    assert PRESETS["tiny-cpu"]["--qrl-max-update-ratio"] == 10.0
    assert all("--qrl-max-update-ratio" not in p for n, p in PRESETS.items() if n != "tiny-cpu")
