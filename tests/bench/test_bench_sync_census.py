"""bench/sync_census.py on a tiny model: the direct sync's op census runs, every variant leaves
the same engine bytes, and the counts show what quantizing in place removes (packed copies;
both quantizing variants read the device once, for the weights' finiteness)."""

from __future__ import annotations

import json

from bench.sync_census import census, engine_storage, main, tiny_config


def test_census_variants_write_the_same_engine_and_count_the_difference(tmp_path, capsys):
    out = tmp_path / "census.jsonl"
    assert main(["--tiny", "--layers", "1", "--experts", "2", "--formats", "fp8,int8",
                 "--out", str(out)]) == 0
    rows = {(r["format"], r["variant"]): r for r in map(json.loads, out.read_text().splitlines())}
    assert len(rows) == 6 and all(r["commit"] for r in rows.values())
    assert "DIFFER" not in capsys.readouterr().out
    for fmt in ("fp8", "int8"):
        into, packed, cached = (rows[fmt, v] for v in ("direct", "direct+packed", "direct+qcache"))
        assert into["engine_sha"] == packed["engine_sha"] == cached["engine_sha"]
        assert into["quantized"] == into["weights"] > 0 and packed["quantized"] == 0
        assert cached["quantized"] == 0 and cached["write_syncs"] == 0
        # one finiteness check each: the writer's, the packed stream's at its end
        assert into["write_syncs"] == packed["write_syncs"] == 1
        assert into["write_fresh_mb"] < packed["write_fresh_mb"]  # no packed copies


def test_engine_storage_has_the_direct_layout():
    """Catches: a census engine whose regions are not where the writer puts them (the
    writer would refuse the stream)."""
    from megatron_qrl.quant import get_spec

    cfg = tiny_config(1, 2)
    layout, tensors = engine_storage(cfg, get_spec("fp8_block"))
    w13 = layout.params["model.layers.0.mlp.experts.w13_weight_scale_inv"]
    assert w13.experts and w13.shards == {"gate_proj": (0, 2), "up_proj": (2, 4)}
    assert tensors["model.layers.0.self_attn.qkv_proj.weight"].dtype.itemsize == 1
    assert census("fp8_block", "direct", cfg)["quantized"] == 1 * (4 + 3)
