"""bench/rollout_throughput.py --engines N --gpus G (nvidia-h200-x2): each engine on
its own GPU with the memory of its GPU, and the scaling table over the one-engine record."""

from __future__ import annotations

import json

import pytest

from bench._fleet import (
    ENGINES_ENV,
    PER_GPU_ENV,
    engine_envs,
    engines_per_gpu,
    fleet_scaling,
    run_fleet,
)


def test_engines_spread_over_gpus_get_their_gpu_and_its_memory(monkeypatch):
    envs = engine_envs({"X": "1"}, 4, 2)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "0", "1"]
    assert {e[PER_GPU_ENV] for e in envs} == {"2"} and {e[ENGINES_ENV] for e in envs} == {"4"}
    assert all(e["X"] == "1" for e in envs)
    one_gpu = engine_envs({}, 2)
    assert all("CUDA_VISIBLE_DEVICES" not in e and PER_GPU_ENV not in e for e in one_gpu)
    for env, share in ((envs[0], 2), (engine_envs({}, 2, 2)[1], 1), (one_gpu[0], 2)):
        monkeypatch.delenv(PER_GPU_ENV, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert engines_per_gpu() == share  # rollout_throughput: 0.85 / this per engine
    with pytest.raises(ValueError, match="--gpus 2"):
        engine_envs({}, 3, 2)


def test_run_fleet_passes_each_engine_its_gpu():
    seen = {}

    def run_one(env, tag):
        seen[tag] = env.get("CUDA_VISIBLE_DEVICES")
        return {"variant": "fp8", "bs64": {"out_tokens": 64, "wall_s": 1.0, "prefill_s": 0.1,
                                           "decode_tok_s": 100.0}}

    res = run_fleet(run_one, {}, 2, [128], gpus=2)
    assert seen == {"engine 0": "0", "engine 1": "1"} and res["gpus"] == 2
    assert res["bs128"]["decode_tok_s"] == 200.0


def test_scaling_over_one_engine_same_total_and_same_per_engine(tmp_path, capsys):
    one = {"variant": "fp8", "bs128": {"decode_tok_s": 1000.0}, "bs256": {"decode_tok_s": 1500.0}}
    fleet = {"variant": "fp8", "engines": 2, "gpus": 2, "bs256": {"decode_tok_s": 1950.0}}
    other = {"variant": "bf16", "engines": 2, "bs256": {"decode_tok_s": 1.0}}  # no 1-engine row
    rows = fleet_scaling([one, fleet, other, {"variant": "fp8", "error": "x", "engines": 2}])
    assert rows == [{"variant": "fp8", "engines": 2, "gpus": 2, "batch": 256,
                     "fleet_tok_s": 1950.0, "same_total": 1.3, "same_per_engine": 1.95}]
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in (one, fleet)) + "\n")
    from bench.rollout_throughput import main

    assert main(["--scaling", str(f)]) == 0
    assert '"same_per_engine": 1.95' in capsys.readouterr().out
