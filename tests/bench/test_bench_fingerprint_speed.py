"""bench/fingerprint_speed.py on a tiny model on the CPU: one row per path with the commit and
its times, every path's fingerprints equal (the kernel's place taken by a torch stand-in of
``segment_sums``; the real kernel under Triton's interpreter: tests/sync/
test_triton_checksums.py), a wrong kernel result reported as a difference (exit status 1), and
the regions the bench fingerprints are the ones the direct writer fingerprints."""

from __future__ import annotations

import ctypes
import json
from types import SimpleNamespace

import pytest
import torch

from bench.fingerprint_speed import PATHS, main, regions, run_checksums
from bench.sync_census import engine_storage, tiny_config
from megatron_qrl.sync.protocol import checksums


def _segment_sums(words, starts, lengths, mod):
    """The kernel's contract in torch: each segment's :func:`checksum_parts`."""
    assert mod == checksums._MOD
    return torch.stack([checksums.checksum_parts(words[s:s + n])
                        for s, n in zip(starts, lengths)])


def _address_sums(addrs, lengths, mod, device):
    """``address_sums``' contract in torch: each segment's :func:`checksum_parts`, its words
    read from host memory at the address."""
    assert mod == checksums._MOD and device.type == "cpu"
    return torch.stack([checksums.checksum_parts(torch.frombuffer(
        (ctypes.c_int32 * int(n)).from_address(int(a)), dtype=torch.int32)) if n else
        torch.zeros(2, dtype=torch.int64) for a, n in zip(addrs, lengths)])


@pytest.fixture
def standin(monkeypatch):
    """The kernel module replaced by :func:`_segment_sums` and :func:`_address_sums`, allowed
    on CPU tensors."""
    kern = SimpleNamespace(segment_sums=_segment_sums, address_sums=_address_sums, BLOCK=1024,
                           ITERS=16, NUM_WARPS=4)
    monkeypatch.setattr(checksums, "_triton_module", lambda: kern)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return kern


def _rows(out):
    return {r["path"]: r for r in map(json.loads, out.read_text().splitlines())}


def test_every_path_gives_a_row_and_the_same_fingerprints(tmp_path, capsys, standin):
    """1 layer x 4 experts: 6 expert stacks (gate / up / down codes and scales) of 4, q / k /
    v / o codes and scales, 4 norms, the router; the embeddings, final norm, output layer."""
    out = tmp_path / "fp.jsonl"
    assert main(["--device", "cpu", "--tiny", "--layers", "1", "--experts", "4",
                 "--repeats", "1", "--warmup", "0", "--out", str(out)]) == 0
    rows = _rows(out)
    assert list(rows) == list(PATHS)
    layout, tensors = engine_storage(tiny_config(1, 4), __import__(
        "megatron_qrl.quant", fromlist=["get_spec"]).get_spec("fp8"))
    held = sum(t.numel() * t.element_size() for t in tensors.values())
    for path, r in rows.items():
        assert r["commit"] and r["cpu_numbers"] is True and r["device"] == "cpu"
        assert r["bytes"] == held and r["experts"] == 4 and "skipped" not in r
        # the ms are rounded to 0.001 ms, gbs / vs_copy are of the unrounded ones (gbs to 4
        # significant digits, vs_copy to 0.01): bound by both roundings
        assert r["ms"] > 0 and r["gbs"] == pytest.approx(held / r["ms"] / 1e6,
                                                         rel=5e-4 / r["ms"] + 1e-3)
        slack = 5e-4 / r["ms"] + 5e-4 / rows["copy"]["ms"] + 1e-3
        assert r["vs_copy"] == pytest.approx(r["ms"] / rows["copy"]["ms"], rel=slack, abs=0.01)
        if path == "copy":
            assert "fingerprints" not in r
        else:
            assert r["agree"] is True and r["same_as"] == "kernel"
            assert r["fingerprints"] == 6 * 4 + 8 + 4 + 1 + 3
    assert rows["checksums"]["impl"] == "torch" and rows["kernel"]["impl"] == "triton"
    assert rows["addresses"]["impl"] == "triton"
    printed = capsys.readouterr().out
    assert "CPU numbers" in printed and "DIFFER" not in printed and "| readback |" in printed


def test_a_wrong_kernel_sum_is_a_difference(tmp_path, capsys, monkeypatch, standin):
    """The kernel path's sums of one expert off by one: its row names where it differs from
    the torch path and the run exits 1."""
    def off_by_one(words, starts, lengths, mod):
        out = _segment_sums(words, starts, lengths, mod)
        if len(starts) >= 8:  # the w13 stacks: gate rows 0-3, up rows 4-7
            out[2, 1] += 1
        return out

    monkeypatch.setattr(standin, "segment_sums", off_by_one)
    out = tmp_path / "fp.jsonl"
    assert main(["--device", "cpu", "--tiny", "--layers", "1", "--experts", "4",
                 "--paths", "torch,kernel", "--repeats", "1", "--warmup", "0",
                 "--no-profile", "--out", str(out)]) == 1
    r = _rows(out)["kernel"]
    assert r["agree"] is False and r["same_as"] == "torch" and ".experts.2." in \
        r["first_difference"]
    assert "DIFFER from torch" in capsys.readouterr().out


def test_without_a_kernel_the_triton_paths_are_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(checksums, "_triton_module", lambda: None)
    out = tmp_path / "fp.jsonl"
    assert main(["--device", "cpu", "--tiny", "--layers", "1", "--experts", "2",
                 "--paths", "kernel,addresses,triton,checksums", "--repeats", "1", "--warmup",
                 "0", "--no-profile", "--out", str(out)]) == 0
    rows = _rows(out)
    assert rows["kernel"]["skipped"] == rows["triton"]["skipped"] == "Triton is not installed"
    assert rows["addresses"]["skipped"] == "Triton is not installed"
    assert rows["checksums"]["agree"] is True and rows["checksums"]["same_as"] == "checksums"


def test_the_regions_are_those_the_direct_writer_fingerprints():
    """The fp8 direct writer quantizes a tiny trainer stream into the storage; the bench's
    regions of that storage give the writer's own fingerprints, name for name."""
    from bench.weight_sync import trainer_stream
    from megatron_qrl.quant import get_spec
    from megatron_qrl.quant.pack_stream import writer_stream
    from megatron_qrl.rollout_sglang.sync.writer import writer_for

    cfg, spec = tiny_config(1, 4), get_spec("fp8")
    layout, tensors = engine_storage(cfg, spec)
    sent = checksums.Checksums()
    with torch.no_grad():
        writer_for(spec, layout, tensors, sent).write_all(
            writer_stream(spec, iter(list(trainer_stream(cfg, "cpu")))))
    want = sent.result()
    got = run_checksums(regions(layout, tensors))
    assert sorted(got) == sorted(want) and got == want


def test_kernel_configs_are_rows_run_under_their_constants(tmp_path, monkeypatch, standin):
    """``--configs``: one more kernel row per ``BLOCKxITERSxWARPS``, run with the kernel
    module's constants set to it (seen by the stand-in) and restored after."""
    kern = standin
    seen, defaults = set(), (kern.BLOCK, kern.ITERS, kern.NUM_WARPS)

    def noting(words, starts, lengths, mod):
        seen.add((kern.BLOCK, kern.ITERS, kern.NUM_WARPS))
        return _segment_sums(words, starts, lengths, mod)

    monkeypatch.setattr(standin, "segment_sums", noting)
    out = tmp_path / "fp.jsonl"
    assert main(["--device", "cpu", "--tiny", "--layers", "1", "--experts", "2",
                 "--paths", "torch,kernel", "--configs", "16x4x1,2048x8x8", "--repeats", "1",
                 "--warmup", "0", "--no-profile", "--out", str(out)]) == 0
    rows = _rows(out)
    assert list(rows) == ["torch", "kernel", "kernel 16x4x1", "kernel 2048x8x8"]
    assert all(r["agree"] and r["impl"] == "triton" for p, r in rows.items() if p != "torch")
    assert seen == {defaults, (16, 4, 1), (2048, 8, 8)}
    assert (kern.BLOCK, kern.ITERS, kern.NUM_WARPS) == defaults


def test_bad_paths_and_configs_are_one_line():
    for bad in ("gpu", "copy,copy", ""):
        with pytest.raises(SystemExit, match="--paths .*copy, kernel"):
            main(["--device", "cpu", "--paths", bad])
    for bad in ("1024x16", "3000x8x4", "1024x8x3", "65536x16x4", "ax8x4"):
        with pytest.raises(SystemExit, match="--configs .*BLOCKxITERSxWARPS"):
            main(["--device", "cpu", "--configs", bad])
