"""H200: a killed SGLang scheduler is restarted, re-synced and the step retried — in the
trainer's process, which survives (SGLang's own SIGQUIT handling would kill it; see
megatron_qrl.rollout_sglang.crash).

    source .stage/recipe/setup.sh
    PYTHONUNBUFFERED=1 python -m pytest -q tests/gpu/test_sglang_restart.py -x -s

In its own process (``python tests/gpu/test_sglang_restart.py OUT.json``): an
:class:`EngineSupervisor` over ``SGLangEngine`` (tiny Qwen3-MoE, int8, in-place sync) syncs
weights B (version 1) and generates greedily; then a scheduler process is SIGKILLed and the
same generate is called again: SGLang's watchdog reports the crash, the call fails with
EngineDiedError, the supervisor starts a new engine, re-syncs version 1 and retries. The
parent checks one restart, version 1 on the new engine and the same greedy tokens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

FMT = "int8"
NEW_TOKENS = 16


STUCK_S = 300
"""The worker dumps every thread's stack and exits after this long (a hang is diagnosable
from the log: the first H200 run of this test hung past the device call's 600 s)."""


def _stage(res: dict, out: Path, name: str) -> None:
    res.setdefault("stages", []).append(name)
    out.write_text(json.dumps(res))
    print(f"[restart worker] {name}", flush=True)


def worker(out: Path) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(STUCK_S, exit=True)
    from megatron_qrl.models.export import export_quantized
    from megatron_qrl.quant import get_spec
    from megatron_qrl.quant.hf_reference import hf_tensors
    from megatron_qrl.rollout import SamplingParams
    from megatron_qrl.rollout.supervisor import EngineSupervisor
    from megatron_qrl.rollout_sglang import SGLangEngine

    sys.path.insert(0, str(HERE))
    from test_sglang_inplace import prompts, source_model

    work = out.parent / "work-restart"
    a, b = source_model(0), source_model(1)
    a.save_pretrained(work / "hf-a")
    export_quantized(work / "hf-a", FMT, work / FMT, overwrite=True, progress=False)
    spec = get_spec(FMT)

    def factory():
        return SGLangEngine(work / FMT, FMT, mem_fraction_static=0.3, random_seed=0)

    def resync(engine, version):
        engine.update_weights(spec.pack_state_dict(hf_tensors(b)), version)

    res: dict = {}
    _stage(res, out, "exported")
    sup = EngineSupervisor(factory, resync, max_restarts=2)
    res["crash_handler"] = sup.engine.crash_handler
    _stage(res, out, "engine started")
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0)
    try:
        sup.update_weights(spec.pack_state_dict(hf_tensors(b)), 1)
        res["before"] = sup.generate(prompts(), greedy).output_ids.tolist()
        _stage(res, out, "synced and generated")
        children = sup.engine.engine.get_all_child_pids()
        victim = children[0]
        os.kill(victim, signal.SIGKILL)
        res |= {"killed_pid": victim, "child_pids": children}
        _stage(res, out, f"SIGKILLed child {victim} of {children}")
        t0 = time.time()
        after = sup.generate(prompts(), greedy)
        res |= {"after": after.output_ids.tolist(), "version": after.weight_version,
                "restarts": sup.restarts, "recovery_s": round(time.time() - t0, 1)}
        print(f"[restart worker] {res['restarts']} restart(s), recovered in "
              f"{res['recovery_s']} s", flush=True)
        _stage(res, out, "recovered")
    finally:
        out.write_text(json.dumps(res))
        sup.shutdown()
        _stage(res, out, "shut down")


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
    raise SystemExit(0)

import pytest  # noqa: E402

from tests.gpu import skip_unless_sglang_gpu  # noqa: E402

skip_unless_sglang_gpu("SGLang restart tests")


@pytest.mark.gpu
def test_killed_scheduler_is_restarted_and_the_step_retried(tmp_path):
    out = tmp_path / "restart.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    try:  # the worker exits by itself after STUCK_S (faulthandler), with every stack printed
        rc = subprocess.run([sys.executable, str(Path(__file__)), str(out)], env=env, cwd=ROOT,
                            timeout=STUCK_S + 60).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    res = json.loads(out.read_text()) if out.is_file() else {}
    assert rc == 0 and "after" in res, (
        f"the trainer process did not survive the killed scheduler (exit {rc}); stages "
        f"reached: {res.get('stages')}; partial result: {res}")
    assert res["crash_handler"], "SGLang's SIGQUIT handlers were not replaced"
    assert res["restarts"] == 1 and res["version"] == 1, res
    same = sum(x == y for p, q in zip(res["before"], res["after"]) for x, y in zip(p, q))
    total = sum(len(p) for p in res["before"])
    print(f"\n[restart] {FMT}: 1 restart, recovered in {res['recovery_s']} s; greedy tokens "
          f"equal to the pre-crash run: {same}/{total}")
    assert same / total >= 0.95  # the same weights and prompts on a fresh engine
