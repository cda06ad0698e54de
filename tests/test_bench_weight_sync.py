"""bench/weight_sync.py: the table and the breakdown plot of a saved run (no GPU needed)."""

import json

import pytest

from bench.weight_sync import main, plot_sync, sync_table

RESULTS = "bench/results/weight_sync_run10_stacked_default.jsonl"


def test_table_of_a_saved_run_lists_every_variant_and_part(capsys):
    assert main(["--table", RESULTS]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [json.loads(x) for x in open(RESULTS)]
    assert len(out) == 2 + len(rows)
    assert out[3].startswith("| fp8:inplace+flat+prefetch+direct+stacked | 31.26 | 1.24 | 3.87 | 3.34 "
                             "| 1.44 | 3.21 | 1.65 | 1.27 | 0.03 | 1.79 |")


def test_failed_variant_keeps_its_row():
    table = sync_table([{"variant": "nvfp4:inplace", "error": "OOM " * 40}])
    assert "| nvfp4:inplace | failed: OOM" in table
    assert table.splitlines()[-1].count("|") == table.splitlines()[0].count("|")


def test_plot_of_a_saved_run_is_a_png(tmp_path, capsys):
    out = tmp_path / "sync.png"
    assert main(["--table", RESULTS, "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {out}" in capsys.readouterr().out


def test_plot_needs_a_second_sync(tmp_path):
    with pytest.raises(ValueError, match="no variant with a second sync"):
        plot_sync([{"variant": "fp8:inplace", "error": "x"}], tmp_path / "p.png")


def test_missing_table_file_names_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--table", str(tmp_path / "nope.jsonl")])
    assert "--table" in capsys.readouterr().err
