"""bench: KV-cache variants, RL-length presets and the full engine-argument record."""

import json

import pytest

from bench.engine_variants import OPTIONS, parse_variant
from bench.rollout_throughput import (
    PRESETS,
    VARIANT_SETS,
    engine_kwargs,
    main,
    model_config,
    resolve,
    table,
)


def test_kv_option_sets_the_cache_dtype_and_the_exactness_arguments():
    p = parse_variant("fp8:kv_fp8_e4m3")
    assert p.engine_kwargs == {"kv_cache_dtype": "fp8_e4m3", "disable_radix_cache": True,
                               "chunked_prefill_size": -1}
    assert parse_variant("w4a16:fa3+kv_fp8_e5m2").engine_kwargs == {
        "attention_backend": "fa3", "kv_cache_dtype": "fp8_e5m2", "disable_radix_cache": True,
        "chunked_prefill_size": -1}
    assert "kv_bf16" not in OPTIONS  # bf16 K/V is the plain variant
    with pytest.raises(ValueError, match="at most one"):
        parse_variant("fp8:kv_fp8_e4m3+kv_fp8_e5m2")


def test_presets_and_the_kv_set_resolve_and_explicit_flags_win():
    class A:
        pass

    a = A()
    a.preset, a.prompt_len, a.new, a.batches, a.variants = "rl-1024", None, 64, None, "kv"
    resolve(a)
    assert (a.prompt_len, a.new, a.batches) == (1024, 64, PRESETS["rl-1024"]["batches"])
    assert a.variants == VARIANT_SETS["kv"]
    assert {"bf16", "fp8", "fp8:kv_fp8_e4m3", "int8:kv_fp8_e4m3", "w4a16:kv_fp8_e4m3"} <= set(
        a.variants.split(","))
    assert (PRESETS["rl-512"]["prompt_len"], PRESETS["rl-512"]["new"]) == (512, 1536)
    with pytest.raises(ValueError, match="unknown option"):
        main(["--variants", "fp8:kv_int4", "--preset", "rl-512"])


def test_every_engine_argument_is_in_the_record_and_extra_wins():
    kw = engine_kwargs("fp8:kv_fp8_e4m3", [256, 128], {"mem_fraction_static": 0.7}, "/m")
    assert kw["kv_cache_dtype"] == "fp8_e4m3" and kw["disable_radix_cache"] is True
    assert kw["attention_backend"] == "triton"  # SGLangEngine's own (the alignment rule's backend)
    assert kw["model_path"] == "/m" and kw["cuda_graph_bs_decode"] == [1, 128, 256]
    assert kw["mem_fraction_static"] == 0.7  # --extra last


def test_table_merges_files_and_names_the_shape(tmp_path, capsys):
    def rec(variant, tok_s):
        return {"variant": variant, "weight_gb": 10.0, "copy_bw_gbs": 4000.0, "prompt_len": 512,
                "new": 1536, "bs256": {"decode_tok_s": tok_s}}

    f1, f2 = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    f1.write_text(json.dumps(rec("bf16", 1000.0)) + "\n")
    f2.write_text(json.dumps(rec("fp8:kv_fp8_e4m3", 1500.0)) + "\n")
    assert main(["--table", str(f1), str(f2), "--batches", "256"]) == 0
    out = capsys.readouterr().out
    assert "512 prompt + 1536 new" in out
    assert "| fp8:kv_fp8_e4m3 | 10.0 | 1,500 (1.50)" in out
    assert table([rec("bf16", 1000.0)], [256], 4000.0).count("(1.00)") == 1


def test_layers_trims_the_30b_shape_names_it_and_refuses_a_bad_count(tmp_path, capsys):
    full, trimmed = model_config(), model_config(12)
    assert full["num_hidden_layers"] == 48
    assert trimmed["num_hidden_layers"] == 12 and trimmed["max_window_layers"] == 12
    assert {k: v for k, v in trimmed.items() if k not in ("num_hidden_layers", "max_window_layers")} \
        == {k: v for k, v in full.items() if k not in ("num_hidden_layers", "max_window_layers")}
    with pytest.raises(SystemExit, match="--layers 49: choose 1..48"):
        model_config(49)
    r = {"variant": "bf16", "weight_gb": 3.0, "copy_bw_gbs": 4000.0, "prompt_len": 1024,
         "new": 4096, "layers": 12, "bs128": {"decode_tok_s": 100.0}}
    assert "1024 prompt + 4096 new, 12 layers" in table([r], [128], 4000.0)
    assert "layers" not in table([r | {"layers": 48}], [128], 4000.0).splitlines()[0]
