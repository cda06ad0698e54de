"""bench/multigpu_summary.py: per-GPU peaks from nvidia-smi's CSV log and the RL step split."""

from __future__ import annotations

import json

from bench.multigpu_summary import gpu_peaks, main, step_split


def test_gpu_peaks_per_index_skip_other_lines():
    lines = ["timestamp, index, memory.used [MiB]", "2026/12/01 10:00:00.000, 0, 1024",
             "2026/12/01 10:00:00.000, 1, 512", "2026/12/01 10:00:01.000, 0, 4096",
             "2026/12/01 10:00:01.000, 1, 2048", "2026/12/01 10:00:02.000, 0, 2048",
             "2026/12/01 10:00:0"]
    assert gpu_peaks(lines) == {0: 4.0, 1: 2.0}


def test_step_split_rl_records_only(tmp_path, capsys):
    recs = [{"phase": "sft", "step": 0, "time_train_s": 9.0},
            {"phase": "rl", "step": 1, "time_rollout_s": 3.0, "time_recompute_s": 1.0,
             "time_train_s": 4.0, "time_sync_s": 2.0, "trainer_peak_gib": 70.5}]
    rows = step_split(recs)
    assert len(rows) == 1 and rows[0]["step"] == 1 and rows[0]["step_s"] == 10.0
    assert rows[0]["share"] == {"time_rollout_s": 0.3, "time_recompute_s": 0.1,
                                "time_train_s": 0.4, "time_sync_s": 0.2}
    assert rows[0]["trainer_peak_gib"] == 70.5
    m, g, out = tmp_path / "m.jsonl", tmp_path / "g.csv", tmp_path / "s.json"
    m.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    g.write_text("t, 0, 100\nt, 3, 2048\n")
    assert main(["--metrics", str(m), "--gpu-log", str(g), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["gpu_peak_gib"] == {"0": 100 / 1024, "3": 2.0}
    assert "GPU 3 peak 2.0 GiB" in capsys.readouterr().out
    assert main(["--metrics", str(tmp_path / "none.jsonl")]) == 1  # the run wrote nothing
