"""bench/_runner.py: one process per variant, its RESULT record or its error, JSONL output."""

import json

from bench._runner import commit, run_variant


def test_result_line_is_collected_and_appended(tmp_path):
    child = tmp_path / "child.py"
    child.write_text("import json, sys\nprint('noise')\n"
                     "print('RESULT ' + json.dumps({'variant': sys.argv[1], 'x': 3}))\n")
    out = tmp_path / "r" / "out.jsonl"
    res = run_variant([str(child), "fp8"], "fp8", out)
    assert res["variant"] == "fp8" and res["x"] == 3 and res["total_s"] >= 0
    assert [json.loads(x)["x"] for x in out.read_text().splitlines()] == [3]


def test_every_record_carries_the_commit(tmp_path):
    """Catches: a variant's record (weight_sync, rl_step, rollout_throughput ...) without the
    commit it measured, unless the child named its own."""
    child = tmp_path / "child.py"
    child.write_text("import json, sys\nrec = {'variant': 'v'}\n"
                     "rec.update({'commit': 'abc1234'} if sys.argv[1:] else {})\n"
                     "print('RESULT ' + json.dumps(rec))\n")
    assert run_variant([str(child)], "v")["commit"] == commit() != ""
    assert run_variant([str(child), "own"], "v")["commit"] == "abc1234"
    crashed = tmp_path / "crash.py"
    crashed.write_text("raise SystemExit('no GPU')\n")
    assert run_variant([str(crashed)], "v")["commit"] == commit()


def test_a_crashing_variant_reports_its_last_error_line(tmp_path):
    child = tmp_path / "child.py"
    child.write_text("raise KeyError('routed_experts')\n")
    res = run_variant([str(child)], "bf16:tensor", None)
    assert res["variant"] == "bf16:tensor" and res["error"] == "KeyError: 'routed_experts'"
