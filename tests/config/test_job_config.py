"""``--qrl-mode`` / ``--qrl-compare`` / ``--qrl-seeds``: flags generated from
:class:`~megatron_qrl.config.job.JobConfig`, and the job's combination rules on the
dataclass (checked without argparse)."""

from __future__ import annotations

import dataclasses
import types

import pytest

from megatron_qrl.config import QrlArgumentError, RolloutConfig, RunConfig, flag_specs
from megatron_qrl.config.job import JobConfig, job_group
from megatron_qrl.config.megatron_flags import parse_megatron_flags
from megatron_qrl.models.lora_config import LoraConfig
from megatron_qrl.rl.cli import build_parser, parse_configs


def _action(parser, flag):
    return next(a for a in parser._actions if flag in a.option_strings)


def test_the_launcher_flags_are_the_dataclass_fields():
    specs = {s.flag: s for s in flag_specs(job_group())}
    assert list(specs) == ["--qrl-compare", "--qrl-seeds", "--qrl-mode"]
    parser = build_parser()
    for flag, s in specs.items():
        a = _action(parser, flag)
        assert (a.dest, a.default) == (s.dest, s.default)
        assert a.help.startswith(s.help[:40])
    assert _action(parser, "--qrl-mode").choices == ["single", "colocated", "disaggregated"]
    assert _action(parser, "--qrl-compare").const == "papers"
    assert _action(parser, "--qrl-seeds").metavar == "S1,S2,..."


def test_a_field_metadata_change_changes_the_flag(monkeypatch):
    """The parser reads the field: a new ``const`` / ``metavar`` in the metadata is the flag's."""
    fields = JobConfig.__dataclass_fields__
    monkeypatch.setattr(fields["compare"], "metadata", types.MappingProxyType({"const": "rlquant"}))
    monkeypatch.setattr(fields["seeds"], "metadata", types.MappingProxyType({"metavar": "LIST"}))
    parser = build_parser()
    assert _action(parser, "--qrl-compare").const == "rlquant"
    assert _action(parser, "--qrl-seeds").metavar == "LIST"
    assert parser.parse_args(["--qrl-compare"]).qrl_compare == "rlquant"


@pytest.mark.parametrize("argv, want", [
    ([], JobConfig()),
    (["--qrl-compare"], JobConfig(compare="papers")),
    (["--qrl-compare=rlquant", "--qrl-seeds", "1,2"], JobConfig("rlquant", "1,2")),
    (["--qrl-mode", "disaggregated"], JobConfig(mode="disaggregated")),
])
def test_parse_configs_builds_the_job(argv, want):
    configs, flags, args = parse_configs(argv)
    assert configs["job"] == want
    assert args.qrl_mode == want.mode  # the namespace keeps the flag's dest
    assert not {"qrl_mode", "qrl_compare", "qrl_seeds"} & set(flags)  # not a stored run flag


def _direct():
    from megatron_qrl.rollout_sglang.options import SGLangOptions

    return RolloutConfig(sglang=SGLangOptions(sync="direct", release_memory=False))


def _configs(**over):
    base = {"run": RunConfig(), "rollout": RolloutConfig(), "lora": LoraConfig()}
    return base | over


@pytest.mark.parametrize("job, over, needle", [
    (JobConfig(mode="colocated"), {"lora": LoraConfig(rank=4)},
     "--qrl-lora-rank 4 with --qrl-mode colocated: the Ray engine actor does not serve LoRA"),
    (JobConfig(), {"rollout": RolloutConfig(num_engines=2)},
     "--qrl-rollout-num-engines 2 / --qrl-rollout-engine-tp 1 / --qrl-rollout-engine-ep 1: "
     "the fleet runs its engines as Ray actors"),
    (JobConfig(compare="papers"), {"run": RunConfig(resume=True)},
     "--qrl-compare cannot be combined with --qrl-resume"),
    (JobConfig(compare="papers"), {"run": RunConfig(steps=0, sft_steps=3)},
     "--qrl-steps 0: nothing to run"),
    (JobConfig(), {"run": RunConfig(steps=0)}, "--qrl-steps 0 with --qrl-sft-steps 0"),
    (JobConfig(mode="colocated"), {"rollout": _direct()},
     "--qrl-rollout-sglang-sync direct writes into the in-process engine of --qrl-mode single"),
])
def test_the_job_checks_its_combinations_without_argparse(job, over, needle):
    with pytest.raises(QrlArgumentError) as info:
        job.check(_configs(**over))
    assert str(info.value).startswith(needle) and "\n" not in str(info.value)
    assert dataclasses.replace(job, mode="colocated", compare=None).problem(_configs()) is None


def test_the_job_checks_its_own_fields_and_the_world():
    with pytest.raises(QrlArgumentError, match="--qrl-seeds is for --qrl-compare"):
        JobConfig(seeds="1")
    with pytest.raises(QrlArgumentError, match="--qrl-seeds '1,1': seeds must be distinct"):
        JobConfig(compare="papers", seeds="1,1")
    with pytest.raises(ValueError, match="--qrl-mode must be one of"):
        JobConfig(mode="ray")
    assert JobConfig(compare="papers", seeds="3,1").seed_list == [3, 1]
    with pytest.raises(QrlArgumentError, match="--qrl-compare runs its variants in one process"):
        JobConfig(compare="papers").check(_configs(), ["--lr", "1e-5"])
    mega, _, _ = parse_megatron_flags(["--tensor-model-parallel-size", "2"])
    with pytest.raises(QrlArgumentError, match="needs 2 trainer ranks: launch with torchrun"):
        JobConfig(mode="colocated").check_world(1, mega)
    with pytest.raises(QrlArgumentError, match="--qrl-compare runs in one process"):
        JobConfig(compare="papers").check_world(2, mega)
    JobConfig().check_world(1, mega)  # single mode: the layout's own check says the rest
    with pytest.raises(QrlArgumentError, match="sync direct needs one unsharded trainer .*tp=2"):
        JobConfig().check(_configs(rollout=_direct()), ["--tensor-model-parallel-size", "2"])
    JobConfig().check(_configs(rollout=_direct()), ["--tensor-model-parallel-size", "1"])


def test_the_job_configs_are_one_typed_object():
    from megatron_qrl.config import QrlConfigs, RunConfig

    configs, _, _ = parse_configs(["--qrl-mode", "colocated", "--", "--lr", "1e-5"])
    assert isinstance(configs, QrlConfigs) and isinstance(configs.run, RunConfig)
    assert configs.run.lr == 1e-5 and configs.job.mode == "colocated"
    assert configs.megatron.describe() and configs["run"] is configs.run  # the mapping view
    assert list(configs) == ["run", "rollout", "train", "routing", "loss", "error_tokens",
                             "uaq", "aqn", "lora", "task", "launch", "megatron", "job"]
    partial = QrlConfigs.of({"run": RunConfig(), "toy": 1})  # a caller's own group: mapping only
    assert partial["toy"] == 1 and "lora" not in partial and partial.get("lora") is None
    with pytest.raises(KeyError):
        partial["lora"]
