"""bench/engine_variants.py: FMT[:OPT+OPT] -> sglang.Engine arguments and child environment."""

import pytest

from bench.engine_variants import OPTIONS, child_env, parse_variant
from bench.rollout_throughput import main as throughput_main


def test_plain_format_changes_nothing_and_uses_our_moe_configs():
    p = parse_variant("fp8")
    assert (p.fmt, p.options, p.engine_kwargs, p.env, p.env_defaults) == ("fp8", (), {}, {}, {})
    assert p.own_moe_configs
    env = child_env(p, {"PATH": "/bin", "SGLANG_MOE_CONFIG_DIR": "/old"}, "/ours")
    assert env == {"PATH": "/bin", "SGLANG_MOE_CONFIG_DIR": "/ours"}


def test_sglang_option_drops_the_moe_config_dir():
    p = parse_variant("fp8_block:sglang")
    assert p.fmt == "fp8_block" and not p.own_moe_configs and p.engine_kwargs == {}
    assert child_env(p, {"SGLANG_MOE_CONFIG_DIR": "/old", "A": "1"}, "/ours") == {"A": "1"}


def test_fa3_sets_the_attention_backend_and_the_sgl_kernel_fa3_path():
    p = parse_variant("fp8:fa3")
    assert p.engine_kwargs == {"attention_backend": "fa3"}
    assert child_env(p, {"SGLANG_USE_SGL_FA3_KERNEL": "0"}, None) == {
        "SGLANG_USE_SGL_FA3_KERNEL": "1"}


def test_deepgemm_forces_the_jit_on_over_the_recipe_default_and_keeps_caller_tunables():
    p = parse_variant("fp8_block:fa3+deepgemm+sglang")
    assert p.options == ("fa3", "deepgemm", "sglang")
    assert p.engine_kwargs == {"attention_backend": "fa3", "fp8_gemm_runner_backend": "deep_gemm",
                               "moe_runner_backend": "deep_gemm"}
    # the recipe's setup.sh exports SGLANG_ENABLE_JIT_DEEPGEMM=0; the variant must win over it
    base = {"SGLANG_ENABLE_JIT_DEEPGEMM": "0", "SGLANG_JIT_DEEPGEMM_PRECOMPILE": "1"}
    assert child_env(p, base, "/ours") == {
        "SGLANG_ENABLE_JIT_DEEPGEMM": "1", "SGLANG_JIT_DEEPGEMM_PRECOMPILE": "1",
        "SGLANG_DG_CACHE_DIR": "/tmp/deep_gemm_cache", "SGLANG_USE_SGL_FA3_KERNEL": "1"}


def test_deepgemm_dense_leaves_the_moe_runner_alone():
    p = parse_variant("fp8_block:deepgemm_dense")
    assert p.engine_kwargs == {"fp8_gemm_runner_backend": "deep_gemm"}
    env = child_env(p, {}, None)
    assert env == {"SGLANG_ENABLE_JIT_DEEPGEMM": "1", "SGLANG_JIT_DEEPGEMM_PRECOMPILE": "0",
                   "SGLANG_DG_CACHE_DIR": "/tmp/deep_gemm_cache"}


@pytest.mark.parametrize("fmt", ["fp8", "bf16", "int8", "nvfp4", "w4a16"])
def test_deepgemm_is_refused_where_sglang_never_calls_it(fmt):
    with pytest.raises(ValueError, match="fp8_block:deepgemm"):
        parse_variant(f"{fmt}:deepgemm")


@pytest.mark.parametrize("variant, match", [
    ("fp8:fa4", r"unknown option\(s\) \['fa4'\].*fa3 \(.*deepgemm_dense"),
    ("fp8:", r"unknown option\(s\) \[''\]"),
    ("fp8:fa3+fa3", "repeated"),
    ("fp8:fa3+flashinfer", "at most one"),
    ("fp8_block:deepgemm+deepgemm_dense", "at most one"),
    (":fa3", "no format"),
])
def test_bad_variants_name_the_known_options(variant, match):
    with pytest.raises(ValueError, match=match):
        parse_variant(variant)


def test_every_documented_option_parses():
    for opt in OPTIONS:
        assert parse_variant(f"fp8_block:{opt}").options == (opt,)


def test_throughput_cli_rejects_a_bad_option_before_touching_the_gpu():
    # copy_bandwidth_gbs (CUDA) comes after the check: a CPU machine reaches the ValueError
    with pytest.raises(ValueError, match="unknown option"):
        throughput_main(["--variants", "bf16,fp8:fast"])
