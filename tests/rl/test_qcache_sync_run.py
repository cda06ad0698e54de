"""A run says how its weight sync quantizes and counts the weights packed from the aligned
forward's Q(W) cache (the CPU job: tiny Qwen3-MoE, int8, the reference engine; its own
megatron world, so apart from tests/rl/test_qcache_sync.py's module-wide one)."""

from __future__ import annotations

import pytest

from megatron_qrl.quant import get_spec
from tests.helpers.te_quant_fixtures import hf_state, tiny_hf


@pytest.mark.slow
@pytest.mark.parametrize("forward,reused", [("aligned", True), ("bf16", False)])
def test_a_run_says_how_its_sync_quantizes_and_counts_the_cached(tmp_path, forward, reused):
    """The CPU job (tiny Qwen3-MoE, int8, the reference engine): with the aligned forward
    every quantized weight of every sync comes from the cache; the log line says which path."""
    from megatron_qrl.models.runtime import single_process_megatron
    from megatron_qrl.rl.cli import parse_configs
    from megatron_qrl.rl.driver import run_job

    small = ["--qrl-sft-steps", "1", "--qrl-prompts-per-step", "2",
             "--qrl-rollout-n-samples-per-prompt", "4", "--qrl-rollout-max-new-tokens", "4",
             "--qrl-micro-batch-size", "8", "--qrl-updates-per-step", "1", "--qrl-steps", "2",
             "--qrl-no-progress", "--no-qrl-tensorboard", "--qrl-train-forward", forward,
             "--qrl-output-dir", str(tmp_path / "run")]
    configs, flags, _ = parse_configs(["--qrl-preset", "tiny-cpu", *small])
    said: list[str] = []
    with single_process_megatron():
        recs = run_job(configs, flags, progress=False, log=said.append)
    lines = [m for m in said if m.startswith("[qrl-train] weight sync quantization:")]
    assert len(lines) == 1, said
    want = "reused from the aligned forward's Q(W) cache (int8" if reused \
        else "quantized by the sync (no aligned-forward cache"
    assert want in lines[0], lines[0]
    rl = [r for r in recs if r["phase"] == "rl"]
    cached = [r.get("sync_cached_tensors") for r in rl]
    spec = get_spec("int8")
    hf, _ = tiny_hf("moe")
    quantized = sum(spec.is_quantized(n) for n in hf_state(hf))
    assert cached == ([quantized] * 2 if reused else [None, None])
