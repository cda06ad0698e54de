"""The qrl-train command lines of tests/gpu/test_multigpu_sglang.py pass qrl-train's
checks as on a 2-GPU H200 node, and give the engine actors the SGLang layout they name (CPU
check: the GPU is declared, the Ray session's layout and the engine spec are computed)."""

from __future__ import annotations

import pytest

from tests.helpers.multigpu_runs import LAYOUTS, STEPS, launcher, qrl_args


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_gpu_commands_pass_the_checks(layout, tmp_path, monkeypatch):
    import megatron_qrl.config.args as args_mod
    from megatron_qrl.rl.cli import parse_configs
    from megatron_qrl.rl.driver import prepare_job
    from megatron_qrl.rl.ray_fleet import fleet_engine_spec
    from megatron_qrl.rollout.fleet_layout import fleet_layout

    ranks, engines, _, _ = LAYOUTS[layout]
    monkeypatch.setattr(args_mod, "_gpu_capability", lambda: (9, 0))  # an H200 (sm90)
    monkeypatch.setenv("WORLD_SIZE", str(ranks))
    configs, _, args = parse_configs(qrl_args(layout, str(tmp_path / "out")))
    ro, run = configs["rollout"], configs["run"]
    assert (args.qrl_mode, ro.engine, ro.num_engines, run.steps, args.world_size) == \
        ("colocated", "sglang", engines, STEPS, ranks)
    assert ("torch.distributed.run" in launcher(layout, 1)) == (ranks > 1)
    job = prepare_job(configs)
    # the FleetSession's layout on 2 GPUs (colocated: the trainer's), then the actors' spec
    fleet = fleet_layout(ro.num_engines, ro.engine_tp, ro.engine_ep, ro.engine, "colocated",
                         trainer_gpus=2, mem_fraction=ro.sglang.mem_fraction)
    assert fleet.num_engines * fleet.gpus_per_engine == 2
    spec = fleet_engine_spec(fleet, ro, job.hf_config, run.seed)
    assert spec.kind == "sglang" and spec.num_gpus == ro.engine_tp
    assert spec.sglang_kwargs.get("tp_size", 1) == ro.engine_tp
    with pytest.raises(ValueError, match="multi-GPU|GPU"):  # one H200: refused with the reason
        fleet_layout(ro.num_engines, 2, 1, ro.engine, "colocated", trainer_gpus=1,
                     mem_fraction=ro.sglang.mem_fraction)
