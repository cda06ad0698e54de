"""--qrl-rollout-sglang-attention-backend (rollout_sglang.attention): auto takes FA3 on Hopper
with SGLang's FA3 kernel and a BF16 KV cache, Triton elsewhere (an FP8 KV cache included: FA3
would round the queries too); fa3 where it cannot run is one error naming what is missing;
the choice reaches ``sglang.Engine`` through the options object and the job's engine spec.
``sglang.Engine`` is a recording stand-in (no SGLang)."""

from __future__ import annotations

import pickle

import pytest

from megatron_qrl.config import qrl_configs_from_args
from megatron_qrl.rollout_sglang import attention, engine
from megatron_qrl.rollout_sglang.attention import choose_attention, fa3_kernel
from megatron_qrl.rollout_sglang.factory import build_engine, engine_spec
from megatron_qrl.rollout_sglang.options import SGLangOptions
from tests.rollout_sglang.test_sglang_deterministic import _Engine, _parse
from tests.rollout_sglang.test_sglang_deterministic import sglang_stand_in as _stand_in

sglang_stand_in = _stand_in

FLAG = "--qrl-rollout-sglang-attention-backend"
SO = "flash_ops.abi3.so"


@pytest.fixture
def kernel(tmp_path):
    return tmp_path / SO


@pytest.mark.parametrize("cap,kv,want", [
    ((9, 0), "bf16", "fa3"),
    ((9, 0), "fp8_e4m3", "triton"),  # FA3 would cast the queries to fp8 as well
    ((8, 0), "bf16", "triton"),
    ((10, 0), "bf16", "triton"),
    (None, "bf16", "triton"),
])
def test_auto_takes_fa3_only_where_it_runs_and_keeps_the_kv_aligned_numerics(cap, kv, want,
                                                                          kernel):
    got = choose_attention("auto", kv, cap, kernel)
    assert got.backend == want
    assert got.why.startswith("auto")
    assert choose_attention("auto", "bf16", (9, 0), None).backend == "triton"  # no kernel


def test_fa3_asked_where_it_cannot_run_names_what_is_missing(kernel):
    with pytest.raises(ValueError, match=rf"{FLAG} fa3: .*stage_fa3.sh"):
        choose_attention("fa3", "bf16", (9, 0), None)
    with pytest.raises(ValueError, match=rf"{FLAG} fa3: .*Hopper.*8.9"):
        choose_attention("fa3", "bf16", (8, 9), kernel)
    asked = choose_attention("fa3", "fp8_e4m3", (9, 0), kernel)
    assert asked.backend == "fa3" and "rounds the queries" in asked.why
    assert choose_attention("flashinfer", "bf16", None, None).backend == "flashinfer"
    with pytest.raises(ValueError, match=FLAG):
        SGLangOptions(attention_backend="fa2")


def test_the_kernel_is_found_in_the_installed_sgl_kernel(tmp_path, monkeypatch):
    """Found by its file (a trimmed site has sgl_kernel without flash_ops), not imported."""
    pkg = tmp_path / "sgl_kernel"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert fa3_kernel() is None
    (pkg / SO).write_bytes(b"")
    assert fa3_kernel() == pkg / SO


def test_the_choice_reaches_sglang_and_the_engine_says_it(sglang_stand_in, kernel, monkeypatch):
    """Catches: the flag dropped on its way (options, the job's pickled engine spec) or the
    engine's fixed ``attention_backend`` winning over the choice."""
    kernel.write_bytes(b"")
    monkeypatch.setattr(engine, "fa3_kernel", lambda: kernel)
    monkeypatch.setattr(engine, "_capability", lambda gpu: (9, 0))
    for argv, want in (((), "fa3"), ((FLAG, "triton"), "triton"),
                       (("--qrl-rollout-kv-cache", "fp8_e4m3"), "triton")):
        cfg = qrl_configs_from_args(_parse("--qrl-rollout-engine", "sglang", *argv))["rollout"]
        spec = pickle.loads(pickle.dumps(engine_spec(cfg, {"num_hidden_layers": 2}, seed=0)))
        eng = build_engine(spec)
        assert _Engine.started[-1]["attention_backend"] == want
        assert eng.attention.backend == want
        assert eng.attention.describe().startswith(f"SGLang attention backend: {want} (")
    monkeypatch.setattr(engine, "_capability", lambda gpu: None)
    cfg = qrl_configs_from_args(_parse("--qrl-rollout-engine", "sglang"))["rollout"]
    build_engine(engine_spec(cfg, {"num_hidden_layers": 2}, seed=0))
    assert _Engine.started[-1]["attention_backend"] == "triton"
    assert attention.BACKENDS[0] == "auto"
