"""tests/gpu's worker runner (``run_json_worker``) on CPU with stand-in workers: a failed
worker's own last output lines (stdout and stderr) are in the pytest failure message, since
the H200 runner may return only a grep of pytest's output (bench/h200.sh phases lora, inplace)."""

from __future__ import annotations

import textwrap

import pytest

from tests.gpu import run_json_worker

FAILING = textwrap.dedent("""
    import sys
    for i in range(100):
        print(f"engine log line {i}", flush=True)
    print("stderr line", file=sys.stderr, flush=True)
    raise RuntimeError("LoRA MoE not supported for backend triton")
""")

PASSING = textwrap.dedent("""
    import json, sys
    print("working", flush=True)
    open(sys.argv[1], "w").write(json.dumps({"done": 1, "x": sys.argv[2]}))
""")


def test_a_failed_worker_reports_its_last_output_lines(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(FAILING)
    with pytest.raises(AssertionError) as err:
        run_json_worker(str(script), [], tmp_path / "out.json", "done", "stand-in", tail=10)
    msg = str(err.value)
    assert "stand-in failed (exit 1)" in msg
    assert "RuntimeError: LoRA MoE not supported for backend triton" in msg  # the traceback
    assert "stderr line" in msg and "engine log line 99" in msg
    assert "engine log line 90" not in msg  # only the tail
    assert msg.count("worker| ") == 11  # the header + 10 lines


def test_a_worker_without_its_done_key_fails_even_with_exit_0(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(PASSING)
    out = tmp_path / "out.json"
    assert run_json_worker(str(script), [str(out), "a"], out, "done", "w") == {"done": 1,
                                                                                  "x": "a"}
    with pytest.raises(AssertionError, match=r"(?s)w failed \(exit 0\).*worker\| working"):
        run_json_worker(str(script), [str(out), "a"], out, "missing", "w")
