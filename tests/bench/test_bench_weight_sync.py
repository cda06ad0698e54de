"""bench/weight_sync.py: the table and the breakdown plot of a saved run (no GPU needed)."""

import json

import pytest

from bench.weight_sync import PARTS, main, plot_sync, sync_table


def _rows() -> list[dict]:
    """Two synthetic runs, every number distinct, one part missing in the second."""
    rows = []
    for i, variant in enumerate(("fp8:inplace+flat", "nvfp4:inplace+direct+stacked")):
        r = {"variant": variant, "packed_gb": 31.0 + i, "pack_s": 1.5 + i, "sync_s_v1": 5.25 + i,
             "sync_s_v2": 3.75 + i, "generated_tokens": 8}
        r |= {f"{p}_s_v2": round(0.01 * (k + 1) + i, 2) for k, p in enumerate(PARTS)}
        r |= {f"{p}_s_v1": 99.0 for p in PARTS}  # the first sync's parts are not in the table
        rows.append(r)
    del rows[1][f"{PARTS[0]}_s_v2"]
    return rows


def _saved(tmp_path) -> str:
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    return str(path)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_table_of_a_saved_run_puts_every_value_under_its_column(tmp_path, capsys):
    assert main(["--table", _saved(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    head = _cells(out[0])
    assert head[:5] == ["variant", "packed GB", "pack s", "sync s (first)", "sync s (second)"]
    assert head[5:] == [f"second: {PARTS[0]} s"] + [f"{p} s" for p in PARTS[1:]]
    keys = ["variant", "packed_gb", "pack_s", "sync_s_v1", "sync_s_v2",
            *(f"{p}_s_v2" for p in PARTS)]
    body = [line for line in out[2:] if line.startswith("|")]
    assert len(body) == 2
    for line, row in zip(body, _rows()):
        assert _cells(line) == [str(row.get(k, "")) for k in keys]


def test_failed_variant_keeps_its_row():
    table = sync_table([{"variant": "nvfp4:inplace", "error": "OOM " * 40}])
    assert "| nvfp4:inplace | failed: OOM" in table
    assert table.splitlines()[-1].count("|") == table.splitlines()[0].count("|")


def test_plot_of_a_saved_run_is_a_png(tmp_path, capsys):
    out = tmp_path / "sync.png"
    assert main(["--table", _saved(tmp_path), "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {out}" in capsys.readouterr().out


def test_plot_needs_a_second_sync(tmp_path):
    with pytest.raises(ValueError, match="no variant with a second sync"):
        plot_sync([{"variant": "fp8:inplace", "error": "x"}], tmp_path / "p.png")


def test_missing_table_file_names_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--table", str(tmp_path / "nope.jsonl")])
    assert "--table" in capsys.readouterr().err


TINY = {"hidden_size": 64, "head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_experts": 4, "moe_intermediate_size": 32, "vocab_size": 96, "num_hidden_layers": 2}


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_produce_only_variants_leave_the_same_fingerprints(fmt):
    """The trainer side of an in-place sync without an engine: every variant sends the same
    weights, so the engine would hold the same fingerprints (the rows of each stack equal
    each expert fingerprinted alone; +qcache packs codes quantized beforehand); stacking puts
    fewer items on the wire."""
    from bench.weight_sync import produce, produce_table
    from megatron_qrl.quant import get_spec

    spec = get_spec(fmt)
    rows = {opts: produce(spec, TINY, opts.split("+"), 1, "cpu") for opts in
            ("flat+direct+stacked", "flat+direct+stacked+fpeach", "flat", "direct",
             "flat+direct+stacked+qcache")}
    assert len({r["fingerprints_sha256"] for r in rows.values()}) == 1
    assert len({r["fingerprints"] for r in rows.values()}) == 1
    assert rows["flat+direct+stacked"]["request_items"] == rows["flat+direct+stacked+fpeach"][
        "request_items"] < rows["direct"]["request_items"]
    assert all(r["buckets_v2"] >= 1 and r["produce_s_v2"] >= 0 for r in rows.values())
    table = produce_table([r | {"variant": f"{fmt}:inplace+{o}", "device": "cpu",
                                "packed_gb": 0.0} for o, r in rows.items()])
    assert "DIFFER" not in table and table.count(f"| {fmt}:inplace+") == len(rows)
    bad = produce_table([rows["flat"] | {"variant": "a", "device": "cpu", "packed_gb": 0},
                         rows["flat"] | {"variant": "b", "device": "cpu", "packed_gb": 0,
                                         "fingerprints_sha256": "0" * 16}])
    assert "FINGERPRINTS DIFFER between variants" in bad


def test_the_dense_4b_shape_streams_every_tensor_of_its_checkpoint():
    """``--model qwen3_4b``: the stream holds exactly the HF tensors of the example's model
    (dense MLP, tied embeddings: no lm_head) with their shapes, and the trainer side of a
    sync runs on it. Catches: MoE names or an lm_head streamed for the dense model (the
    engine would refuse the sync)."""
    from bench.weight_sync import model_config, produce, trainer_stream
    from megatron_qrl.models.hf_config import arch_from_dict
    from megatron_qrl.models.mapping import expected_hf_shapes
    from megatron_qrl.quant import get_spec

    cfg = model_config(layers=1, model="qwen3_4b")
    got = {n: tuple(t.shape) for n, t in trainer_stream(cfg, "cpu")}
    assert got == expected_hf_shapes(arch_from_dict(cfg))
    assert produce(get_spec("fp8"), cfg, ["flat", "direct"], 64, "cpu")["buckets_v2"] >= 1
    with pytest.raises(ValueError, match="--experts: --model qwen3_4b is dense"):
        model_config(experts=4, model="qwen3_4b")
    with pytest.raises(ValueError, match="--model 'llama'"):
        model_config(model="llama")


def test_params_streams_every_layer_from_its_own_tensors():
    """``+params``: the stream a trainer's parameters give (each layer its own storages, the
    same names and shapes as the one-layer stream); +qcache with it is refused (its codes are
    one layer's). Catches: layers sharing storage under +params (the engine would open one
    layer's handles where a trainer has one per layer)."""
    from bench.weight_sync import child, model_config, trainer_stream

    cfg = model_config(layers=2, experts=4)
    shared, own = dict(trainer_stream(cfg, "cpu")), dict(trainer_stream(cfg, "cpu", distinct=True))
    assert {n: t.shape for n, t in shared.items()} == {n: t.shape for n, t in own.items()}

    def storages(named, layer):
        return {t.untyped_storage().data_ptr() for n, t in named.items()
                if n.startswith(f"model.layers.{layer}.")}

    assert storages(shared, 0) == storages(shared, 1)
    assert not storages(own, 0) & storages(own, 1)
    with pytest.raises(ValueError, match=r"\+qcache repeats one layer's codes"):
        child("fp8:direct+params+qcache", 1)


def test_produce_only_refuses_what_it_cannot_time():
    from bench.weight_sync import child, model_config

    with pytest.raises(ValueError, match="--produce-only times the in-place sync"):
        child("fp8:tensor", 1, produce_only=True, device="cpu")
    with pytest.raises(ValueError, match="unknown options.*fpeach"):
        child("fp8:inplace+fast", 1, produce_only=True, device="cpu")
    with pytest.raises(ValueError, match="--layers must be >= 1"):
        model_config(layers=0)
    cut = model_config(layers=1, experts=4)
    assert cut["num_hidden_layers"] == 1 and cut["num_experts"] == cut["num_experts_per_tok"] == 4


def test_engine_variant_options_are_checked_before_any_work():
    """Options of --produce-only / --pack-only, and +packed outside the direct sync, are
    refused for an engine variant at once (before the 30B pack is timed), naming the option."""
    from bench.weight_sync import child

    with pytest.raises(ValueError, match="fpeach is a --produce-only option"):
        child("fp8:inplace+flat+direct+stacked+fpeach", 1)
    with pytest.raises(ValueError, match=r"\+packed \(the packed stream copied\) is an option "
                       "of FMT:direct"):
        child("fp8:inplace+flat+direct+stacked+packed", 1)
    with pytest.raises(ValueError, match="--device / --layers / --experts apply to"):
        child("fp8:inplace", 1, device="cpu")


def test_pack_profile_traces_the_pack_on_cpu(tmp_path):
    """bench/pack_profile.py on the CPU (1 layer, 4 experts): the traced pack yields the same
    packed bytes as the untimed pack of bench/weight_sync.py and names the quantizer's ops."""
    from bench.pack_profile import main as profile_main
    from bench.weight_sync import model_config, time_pack
    from megatron_qrl.quant import get_spec

    out = tmp_path / "p.json"
    assert profile_main(["--format", "fp8", "--layers", "1", "--experts", "4",
                         "--device", "cpu", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    _, nbytes = time_pack(get_spec("fp8"), model_config(1, 4), device="cpu")
    assert res["packed_gb"] == round(nbytes / 1e9, 3) and res["gpu_busy_s"] is None
    ops = {name for name, _, _ in res["top_host_self_ms"]}
    assert "aten::clamp" in ops or "aten::amax" in ops, ops


def test_pack_profile_ab_runs_each_quantizer(tmp_path, capsys):
    """``--quant-impl torch,auto`` profiles the pack once per quantizer in one run (on the CPU
    both are the torch reference: same bytes), records the commit; a bad name is one line."""
    from bench.pack_profile import _ratios
    from bench.pack_profile import main as profile_main

    out = tmp_path / "ab.json"
    assert profile_main(["--format", "w4a16", "--layers", "1", "--experts", "2", "--device",
                         "cpu", "--quant-impl", "torch,auto", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["quant_impl"] for r in res["runs"]] == ["torch", "auto"]
    assert len({r["packed_gb"] for r in res["runs"]}) == 1 and "commit" in res
    assert _ratios([{"quant_impl": "torch", "wall_s": 1.0, "gpu_busy_s": 0.9},
                    {"quant_impl": "triton", "wall_s": 0.25, "gpu_busy_s": 0.1}]) == {
        "wall_ratio": 4.0, "gpu_busy_ratio": 9.0}
    with pytest.raises(SystemExit, match="--quant-impl 'cuda'.*auto, torch, triton"):
        profile_main(["--format", "fp8", "--device", "cpu", "--quant-impl", "cuda"])


def test_gpu_busy_counts_each_kernel_once():
    """megatron_qrl/utils/profile.py's ``gpu_busy_s`` on a GPU trace's averages: the kernel's own time only,
    not again as its launching op's ``self_device_time_total`` nor as the ``record_function``
    range's GPU annotation around it; the top list names kernels. Catches: the sum over every
    event (the 30B direct sync's write read 1.11 s busy where its kernels took ~0.2 s)."""
    from types import SimpleNamespace as E

    from megatron_qrl.utils.profile import summarize

    cpu, cuda = "DeviceType.CPU", "DeviceType.CUDA"
    events = [
        E(key="aten::mul", device_type=cpu, is_user_annotation=False, self_device_time_total=150e3,
          self_cpu_time_total=20e3, cpu_time_total=20e3, count=3),
        E(key="elementwise_kernel", device_type=cuda, is_user_annotation=False,
          self_device_time_total=150e3, self_cpu_time_total=0.0, cpu_time_total=0.0, count=3),
        E(key="Memcpy DtoD", device_type=cuda, is_user_annotation=False,
          self_device_time_total=10e3, self_cpu_time_total=0.0, cpu_time_total=0.0, count=1),
        E(key="qrl.direct.write", device_type=cuda, is_user_annotation=True,
          self_device_time_total=160e3, self_cpu_time_total=0.0, cpu_time_total=0.0, count=1),
        E(key="qrl.direct.write", device_type=cpu, is_user_annotation=True,
          self_device_time_total=0.0, self_cpu_time_total=400e3, cpu_time_total=900e3, count=1),
    ]
    s = summarize(events, 1.2, on_gpu=True, top=5)
    assert s["gpu_busy_s"] == 0.16
    assert [name for name, _, _ in s["top_time_ms"]] == ["elementwise_kernel", "Memcpy DtoD"]


def test_profile_summary_names_ranges_host_syncs_and_the_trace(tmp_path):
    """megatron_qrl/utils/profile.py (``weight_sync.py --profile``, ``pack_profile.py``) on the CPU: the
    direct sync's write range, a host sync (``.item()``) and the top ops reach the summary;
    the trace is written per variant. Catches: the write range or the syncs dropped from the
    record, two variants' traces written to one file."""
    import time

    import torch

    from bench.weight_sync import main, trace_path
    from megatron_qrl.rollout_sglang.sync.transports.direct import WRITE_RANGE
    from megatron_qrl.utils.profile import Traced

    x = torch.randn(64, 64)
    with Traced("cpu") as tr:
        with torch.profiler.record_function(WRITE_RANGE):
            (x @ x).abs().amax().item()
        time.sleep(0.005)  # wall_s has 3 decimals: the matmul alone can round to 0.0
    s = tr.summary(top=5)
    assert s["gpu_busy_s"] is None and s["wall_s"] > 0
    assert list(s["ranges_ms"]) == ["qrl.direct.write"]
    assert s["host_syncs"] == {"aten::_local_scalar_dense": 1}
    assert "aten::mm" in {name for name, _, _ in s["top_host_self_ms"]}
    a, b = (trace_path(str(tmp_path / "t.json"), v) for v in ("fp8:direct+resident",
                                                               "fp8:direct+resident+packed"))
    assert a.name == "t-fp8-direct-resident.json" and a != b
    assert a.exists() is False and tr.export(a) == str(a) and a.is_file()
    with pytest.raises(SystemExit):
        main(["--pack-only", "--profile", str(tmp_path / "t.json"), "--variants", "fp8:inplace"])
