"""--qrl-rollout-sglang-sleep-on-idle (default on): from the flag through the one options object
to SGLang's ``sleep_on_idle``. SGLang 0.5.17's idle scheduler otherwise polls its sockets at
100% of a core through every training phase beside the trainer (``scheduler.py``
``init_idle_sleeper``: a ``zmq.Poller`` on the tokenizer and RPC sockets, so a request — a
generate or any weight-sync call, which all arrive through ``update_weights_from_tensor`` or
``generate`` — wakes it at once). ``sglang.Engine`` is a recording stand-in (no SGLang)."""

from __future__ import annotations

import pickle

from megatron_qrl.config import qrl_configs_from_args
from megatron_qrl.rollout_sglang.factory import build_engine, engine_spec
from megatron_qrl.rollout_sglang.options import SGLangOptions
from tests.rollout_sglang.test_sglang_deterministic import _Engine, _parse
from tests.rollout_sglang.test_sglang_deterministic import sglang_stand_in as _stand_in

sglang_stand_in = _stand_in  # the recording sglang.Engine, as a fixture of this module

FLAG = "--qrl-rollout-sglang-sleep-on-idle"


def test_the_engine_sleeps_when_idle_unless_told_not_to(sglang_stand_in):
    """Catches: the option dropped on its way to ``sglang.Engine`` (by the options' kwargs, the
    job's engine spec or a Ray actor's pickled copy), or its default turned off."""
    for argv, want in (((), True), ((f"--no-{FLAG[2:]}",), False), ((FLAG,), True)):
        cfg = qrl_configs_from_args(_parse("--qrl-rollout-engine", "sglang", *argv))["rollout"]
        assert cfg.sglang.sleep_on_idle is want
        spec = pickle.loads(pickle.dumps(engine_spec(cfg, {"num_hidden_layers": 2}, seed=0)))
        eng = build_engine(spec)
        assert eng.options.sleep_on_idle is want
        assert _Engine.started[-1].get("sleep_on_idle", False) is want
    assert SGLangOptions(sleep_on_idle=False).engine_kwargs == {
        "mem_fraction_static": 0.5, "kv_cache_dtype": "bf16"}
