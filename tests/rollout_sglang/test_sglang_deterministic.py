"""--qrl-rollout-sglang-deterministic: from the flag through the one options object
to SGLang's ``enable_deterministic_inference``, and what a seeded sampling sends to SGLang.

SGLang 0.5.17 uses a request's ``sampling_seed`` only with deterministic inference on
(``sampling_batch_info.py``); without it the engine sends no seed and warns ONCE per engine;
with it every row gets its own seed (SGLang hashes (seed, position) into the noise: one seed
for a prompt group's equal prompts would give equal samples). ``sglang.Engine`` is a
recording stand-in (no SGLang, no GPU); the numbers are GPU tests
(tests/gpu/test_sglang_fleet.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import pickle
import tempfile
import types

import pytest
import torch

from megatron_qrl.config import add_qrl_args, qrl_configs_from_args
from megatron_qrl.quant import get_spec
from megatron_qrl.quant.hf_reference import hf_tensors
from megatron_qrl.rollout.base import SamplingParams
from megatron_qrl.rollout.reference import ReferenceEngine, build_hf_model
from megatron_qrl.rollout.sampling import row_seeds
from megatron_qrl.rollout_sglang import crash, engine
from megatron_qrl.rollout_sglang.factory import build_engine, engine_spec
from megatron_qrl.rollout_sglang.options import SGLangOptions
from tests.helpers.tiny_hf import tiny_config

FLAG = "--qrl-rollout-sglang-deterministic"
SEEDED = SamplingParams(max_new_tokens=2, temperature=1.0, seed=7)


class _Engine:
    """The parts of ``sglang.Engine`` SGLangEngine starts and generates with."""

    started: list[dict] = []

    def __init__(self, **kw):
        self.kw, self.requests = kw, []
        _Engine.started.append(kw)

    def generate(self, **kw):
        self.requests.append(kw)
        return [{"output_ids": [5, 6], "meta_info": {
            "output_token_logprobs": [(-0.5, 5, None), (-0.7, 6, None)],
            "finish_reason": {"type": "length"}}} for _ in kw["input_ids"]]


@pytest.fixture
def sglang_stand_in(monkeypatch, tmp_path):
    _Engine.started = []
    monkeypatch.setattr(engine, "require", lambda *a, **k: types.SimpleNamespace(Engine=_Engine))
    monkeypatch.setattr(crash, "install", lambda eng: False)
    monkeypatch.setenv("SGLANG_MOE_CONFIG_DIR", "")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the job engine's config directory
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    return tmp_path


def _parse(*argv: str) -> argparse.Namespace:
    return add_qrl_args(argparse.ArgumentParser(allow_abbrev=False)).parse_args(list(argv))


def _sglang(path, **options) -> engine.SGLangEngine:
    eng = engine.SGLangEngine(path, "bf16", SGLangOptions(**options), trainer_device="cpu")
    eng._version = 1  # as after the first sync (generate refuses before it)
    return eng


def test_the_flag_reaches_sglang_through_the_options_object(sglang_stand_in):
    for argv, want in (((), False), ((FLAG,), True), ((FLAG, f"--no-{FLAG[2:]}"), False)):
        cfg = qrl_configs_from_args(_parse("--qrl-rollout-engine", "sglang", *argv))["rollout"]
        assert cfg.sglang.deterministic is want
        spec = pickle.loads(pickle.dumps(engine_spec(cfg, {"num_hidden_layers": 2}, seed=0)))
        eng = build_engine(spec)  # the job engine, as in a Ray engine actor
        assert eng.options.deterministic is want  # resolve() keeps it
        kw = _Engine.started[-1]
        assert kw.get("enable_deterministic_inference", False) is want
        # what SGLang 0.5.17 then forces or allows: our defaults already satisfy it
        assert (kw["sampling_backend"], kw["attention_backend"]) == ("pytorch", "triton")
        assert kw["mem_fraction_static"] == cfg.sglang.mem_fraction
    assert SGLangOptions(deterministic=True).engine_kwargs == {
        "mem_fraction_static": 0.5, "kv_cache_dtype": "bf16",
        "enable_deterministic_inference": True, "sleep_on_idle": True}
    assert "enable_deterministic_inference" not in SGLangOptions().engine_kwargs


def test_help_says_what_it_does_and_its_cost(capsys):
    with pytest.raises(SystemExit):
        _parse("-h")
    text = " ".join(capsys.readouterr().out.split())
    at = text.rindex(f"--no-{FLAG[2:]}")  # the flag's entry (after the usage line)
    help_text = text[at:at + 1500]
    assert "enable_deterministic_inference" in help_text and "decode speed" in help_text


def _warnings(caplog) -> list[str]:
    """Warnings from this package's loggers (transformers may log its own deprecations)."""
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("megatron_qrl")]


def test_seeded_sampling_on_a_non_deterministic_engine_warns_once_per_engine(
        sglang_stand_in, caplog):
    caplog.set_level(logging.WARNING)
    a, b = _sglang(sglang_stand_in), _sglang(sglang_stand_in)
    for _ in range(3):
        a.generate([[1, 2], [1, 2]], SEEDED)
    assert _warnings(caplog) == [engine.UNSEEDED_WARNING]
    assert FLAG in engine.UNSEEDED_WARNING
    # SGLang would ignore it: nothing seeded is sent, one parameter set for the batch
    assert "sampling_seed" not in a.engine.requests[-1]["sampling_params"]
    b.generate([[3]], SEEDED)  # another engine says it too, once
    b.generate([[3]], SEEDED)
    assert _warnings(caplog) == [engine.UNSEEDED_WARNING] * 2


def test_no_warning_unseeded_greedy_or_deterministic(sglang_stand_in, caplog):
    caplog.set_level(logging.WARNING)
    plain = _sglang(sglang_stand_in)
    plain.generate([[1]], SamplingParams(max_new_tokens=2, temperature=1.0))  # no seed
    plain.generate([[1]], SamplingParams(max_new_tokens=2, temperature=0.0, seed=7))  # greedy
    det = _sglang(sglang_stand_in, deterministic=True)
    for _ in range(2):
        det.generate([[1, 2], [1, 2], [4]], SEEDED)
    assert _warnings(caplog) == []
    sent = det.engine.requests[-1]["sampling_params"]
    # one parameter set per row, each with its own seed (a group's equal prompts differ)
    assert [p["sampling_seed"] for p in sent] == row_seeds(SEEDED.seed, 3)
    assert len(set(row_seeds(SEEDED.seed, 3))) == 3
    assert all(p["temperature"] == 1.0 and p["max_new_tokens"] == 2 for p in sent)
    greedy = det.generate([[1]], SamplingParams(max_new_tokens=2, temperature=0.0, seed=7))
    assert greedy is not None and "sampling_seed" not in det.engine.requests[-1]["sampling_params"]


def test_the_reference_engine_honours_seeds_without_a_warning(caplog):
    caplog.set_level(logging.WARNING)
    cfg = tiny_config("dense")
    torch.manual_seed(0)
    ref = ReferenceEngine(cfg, "bf16", device="cpu", dtype=torch.float32, seed=0)
    ref.update_weights(get_spec("bf16").pack_state_dict(
        hf_tensors(build_hf_model(cfg, torch.float32, "cpu"))), 1)
    prompts = [[1, 2, 3], [1, 2, 3]]
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11)
    one, two = ref.generate(prompts, sampling), ref.generate(prompts, sampling)
    assert torch.equal(one.output_ids, two.output_ids)  # the seed selects the samples
    assert not torch.equal(one.output_ids[0], one.output_ids[1])  # rows of a group differ
    assert _warnings(caplog) == []
