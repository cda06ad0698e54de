"""How many samples an engine decodes at once (rollout.capacity), read from SGLang's server
info (rollout_sglang.server_info), logged at start and recorded per rollout (the engine's
limits and ``rollout_waves``); the engine actor of the Ray modes reports it through its proxy
in tests/rl/test_rl_ray.py."""

from __future__ import annotations

from megatron_qrl.rl.cli import parse_configs
from megatron_qrl.rollout.capacity import EngineCapacity, capacity_record, decode_waves
from megatron_qrl.rollout_sglang.server_info import capacity_from_server_info
from tests.helpers.rl_engine_double import PooledEngine


def test_the_kv_pool_or_the_batch_limit_bounds_what_decodes_at_once():
    """256 samples of 4,096 positions in a 400,000-token pool: 97 at once, 3 waves; the batch
    limit bounds it where the pool is large. Fails when ``at_once`` ignores either limit."""
    pool = EngineCapacity(max_running_requests=256, kv_pool_tokens=400_000)
    assert pool.at_once(4096) == 97
    line = pool.describe(256, 4096)
    assert "97 samples of up to 4,096 tokens" in line and "decode in 3 waves" in line, line
    wide = EngineCapacity(max_running_requests=64, kv_pool_tokens=10**7)
    assert wide.at_once(4096) == 64 and "decode in 4 waves" in wide.describe(256, 4096)
    assert "all decode at once" in wide.describe(64, 4096)
    assert EngineCapacity(8, 100).at_once(4096) == 1  # a sample longer than the pool: one


def test_waves_of_a_rollout_from_the_tokens_it_generated():
    """The lower bound on waves: requests over the batch limit, positions over the pool."""
    cap = EngineCapacity(max_running_requests=4, kv_pool_tokens=1000)
    assert decode_waves(cap, [10] * 4) == 1
    assert decode_waves(cap, [10] * 9) == 3  # by requests
    assert decode_waves(cap, [300] * 4) == 2  # 1,200 positions in a 1,000-token pool
    assert decode_waves(cap, []) == 0


def test_capacity_from_sglang_server_info():
    """SGLang 0.5.17's ``get_server_info()``: the scheduler's KV pool size at the top level,
    the batch limit it settled on in ``internal_states`` (the server argument only caps it)."""
    info = {"max_running_requests": None, "max_total_num_tokens": 412_345,
            "internal_states": [{"effective_max_running_requests_per_dp": 2048}]}
    assert capacity_from_server_info(info) == EngineCapacity(2048, 412_345)
    info["internal_states"] = [{}]
    info["max_running_requests"] = 96
    assert capacity_from_server_info(info) == EngineCapacity(96, 412_345)
    assert capacity_from_server_info({"internal_states": []}) is None


def test_the_run_logs_the_capacity_and_records_the_waves_of_each_rollout(tmp_path):
    """4 samples per step on an engine of 3 requests at once: the start line says 2 waves and
    each RL record has ``rollout_waves`` 2. Fails without the engine's capacity read."""
    from megatron_qrl.models.runtime import single_process_megatron
    from megatron_qrl.rl.driver import run_job

    configs, flags, _ = parse_configs([
        "--qrl-preset", "tiny-cpu", "--qrl-model", "tiny-dense", "--qrl-train-forward", "bf16",
        "--qrl-routing-replay", "off", "--qrl-sft-steps", "0", "--qrl-steps", "2",
        "--qrl-prompts-per-step", "2", "--qrl-rollout-n-samples-per-prompt", "2",
        "--qrl-rollout-max-new-tokens", "3", "--qrl-micro-batch-size", "2",
        "--qrl-save-interval", "-1", "--qrl-output-dir", str(tmp_path)])
    lines: list[str] = []
    with single_process_megatron():
        records = run_job(configs, flags, progress=False, log=lines.append,
                          engine_factory=lambda ro, hf, seed: PooledEngine(hf, ro.format, seed))
    said = [m for m in lines if "engine capacity" in m]
    assert len(said) == 1 and "up to 3 requests at once" in said[0], lines
    assert "4 samples per rollout: they decode in 2 waves" in said[0], said
    rl = [r for r in records if r.get("phase") == "rl"]
    assert len(rl) == 2 and all(r["rollout_waves"] == 2 for r in rl), rl
    assert all(r["engine_max_running_requests"] == 3 and r["engine_kv_pool_tokens"] == 10_000
               for r in rl), rl


def test_a_rollout_record_carries_the_engine_limits_and_its_waves():
    """Nothing without a reported capacity (the reference engine); else the two limits and
    the waves of the samples as generated."""
    assert capacity_record(None, [10] * 9) == {}
    assert capacity_record(EngineCapacity(4, 1000), [10] * 9) == {
        "engine_max_running_requests": 4, "engine_kv_pool_tokens": 1000, "rollout_waves": 3}
