"""bench/slime_log.py reads slime's own per-step log lines (formats copied from a real run's
log, bench/results/slime_baseline_1a18f9e.log)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import slime_log  # noqa: E402

ESC = "\x1b[36m"
HEAD = ("# nvidia-h200 2026-12-03, commit abc1234: QRL=1 LOSS=tbpo LAYERS=8, "
        "SGLang 0.5.15.post1 from /tmp/sg515_site/sglang")


def _line(actor, kind, n, body):
    return (f"{ESC}({actor} pid=5339)\x1b[0m [2026-12-03 09:01:40] model.py:918 - "
            f"{kind} {n}: {body!r}")


def _log(tmp_path, head=HEAD, steps=2):
    lines = [head, "2026-12-03 08:58:22,637\tINFO usage_lib.py:448 -- Usage stats"]
    for n in range(steps):
        lines += [
            _line("RolloutManager", "perf", n, {"perf/rollout_time": 1.5 + n,
                                                "rollout/response_len/mean": 256.0}),
            _line("MegatronTrainRayActor", "rollout", n, {"rollout/raw_reward": 0.25 * n}),
            _line("MegatronTrainRayActor", "step", n, {
                "train/pg_loss": 0.1, "train/kl_behav_prox_k3": 1e-3 * (n + 1),
                "train/train_rollout_logprob_abs_diff": 0.015, "train/qrl_error_frac": 0.5}),
            _line("MegatronTrainRayActor", "perf", n, {"perf/train_time": 10.0 if n == 0 else 1.0,
                                                       "perf/step_time": 17.0,
                                                       "perf/update_weights_time": 0.2}),
        ]
    p = tmp_path / "slime_qrl_tbpo.log"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_the_four_records_of_a_step_are_joined_and_the_two_perf_lines_kept_apart(tmp_path):
    recs = slime_log.records(_log(tmp_path))
    assert [r["step"] for r in recs] == [0, 1]
    r = recs[1]
    assert r["variant"] == "qrl_tbpo" and r["commit"] == "abc1234" and r["sglang"] == "0.5.15.post1"
    assert r["rollout_s"] == 2.5 and r["train_s"] == 1.0  # rollout manager's vs trainer's perf
    assert r["raw_reward"] == 0.25 and r["kl_behav_prox_k3"] == 2e-3
    assert r["qrl_error_frac"] == 0.5 and r["update_weights_s"] == 0.2


def test_the_table_leaves_the_first_step_out_of_its_means(tmp_path):
    text = slime_log.table(slime_log.records(_log(tmp_path, steps=3)))
    row = next(line for line in text.splitlines() if line.startswith("| qrl_tbpo"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "3"                       # steps
    assert cells[2] == "3"                       # rollout_s: mean(2.5, 3.5), step 0 left out
    assert cells[3] == "1"                       # train_s: step 0's 10 s left out


def test_out_is_one_json_line_per_step_and_bad_logs_are_named(tmp_path, capsys):
    out = tmp_path / "slime.jsonl"
    assert slime_log.main([str(_log(tmp_path)), "--out", str(out)]) == 0
    assert [json.loads(x)["step"] for x in out.read_text().splitlines()] == [0, 1]
    assert not out.with_suffix(".jsonl.tmp").exists()
    bad = tmp_path / "other.log"
    bad.write_text("no header\n")
    assert slime_log.main([str(bad)]) == 2
    assert "bench/slime.sh's header" in capsys.readouterr().err
    empty = tmp_path / "empty.log"
    empty.write_text(HEAD + "\nTraceback ...\n")
    assert slime_log.main([str(empty)]) == 2
    assert "no step records" in capsys.readouterr().err


def test_the_committed_baseline_log_parses_to_three_steps():
    log = ROOT / "bench" / "results" / "slime_baseline_1a18f9e.log"
    recs = slime_log.records(log)
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert all(r["variant"] == "baseline" and "logprob_abs_diff" in r for r in recs)


def test_the_committed_qrl_log_reports_the_mismatch_from_our_loss_metrics():
    """With megatron_qrl's custom loss slime logs no ``train_rollout_logprob_abs_diff``; the
    table's |train - rollout| column then comes from our ``train/logp_abs_diff_mean`` (the
    same token mean). Fails if that key is not read (the QRL row's cell stays empty)."""
    log = ROOT / "bench" / "results" / "slime_qrl_acr_38ae4bb.log"
    recs = slime_log.records(log)
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert all(r["variant"] == "qrl_acr" and r["commit"] == "38ae4bb" for r in recs)
    assert all(0 < r["logprob_abs_diff"] < 1 and r["kl_behav_prox_k3"] > 0 for r in recs)
