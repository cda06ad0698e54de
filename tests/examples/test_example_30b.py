"""examples/run_qwen3_30b_a3b.sh as the 8-GPU run calls it (bench/run_30b_example.sh):
every flag exists and the whole command line passes qrl-train's checks, as on an H200 node
(CPU check: torchrun / ray are stand-ins that print the arguments; the GPU, Transformer Engine
and the 8 torchrun ranks are declared, not present)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from megatron_qrl.config.args import QrlArgumentError
from tests.examples.test_rl_examples import _captured_args

ROOT = Path(__file__).resolve().parents[2]
WRAPPER = ROOT / "bench" / "run_30b_example.sh"


def _random_checkpoint_config(d: Path, layers: int) -> Path:
    """config.json and the char tokenizer as tools/make_random_checkpoint.py writes them; the
    weights are one placeholder safetensors file (prepare_job reads none)."""
    sys.path.insert(0, str(ROOT / "tools"))
    from make_random_checkpoint import load_config

    from megatron_qrl.data import CharTokenizer

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(load_config("qwen3_30b_a3b", layers)))
    CharTokenizer().save(d, hf=True)
    from safetensors.torch import save_file

    save_file({"placeholder": torch.zeros(1)}, str(d / "model.safetensors"))
    return d


def _parse_on_h200(argv: list[str], monkeypatch, world: int):
    """``parse_configs`` then ``prepare_job`` (the checkpoint's shape vs the Megatron flags and
    the TP / EP layout, no weights read), as qrl-train's rank 0 does before building."""
    import megatron_qrl.config.args as args_mod
    import megatron_qrl.models.builder as builder
    from megatron_qrl.rl.cli import parse_configs
    from megatron_qrl.rl.driver import prepare_job

    monkeypatch.setattr(args_mod, "_gpu_capability", lambda: (9, 0))  # an H200 (sm90)
    monkeypatch.setattr(builder, "use_transformer_engine", lambda: True)  # te-load done
    monkeypatch.setenv("WORLD_SIZE", str(world))  # torchrun --nproc-per-node world
    configs, flags, args = parse_configs(argv)
    return configs, flags, args, prepare_job(configs)


@pytest.mark.parametrize("gpus,layers", [(8, 8), (4, 6)])
def test_issue21_run_parses_on_one_node(tmp_path, monkeypatch, gpus, layers):
    ckpt = _random_checkpoint_config(tmp_path / "ckpt", layers)
    argv = _captured_args(tmp_path, WRAPPER, {"CKPT": str(ckpt), "LAYERS": str(layers),
                                              "GPUS": str(gpus)})
    assert argv[:2] == ["--qrl-mode", "colocated"]
    configs, flags, args, job = _parse_on_h200(argv, monkeypatch, gpus)
    assert job.arch.num_layers == layers and job.arch.num_experts == 128
    ro, run, mega = configs["rollout"], configs["run"], configs["megatron"]
    assert (ro.engine, ro.format, ro.num_engines, ro.engine_tp, ro.max_new_tokens) == \
        ("sglang", "fp8_block", gpus, 1, 256)
    assert (run.steps, run.save_interval, args.world_size) == (3, -1, gpus)
    assert flags["megatron_layout"] == f"tp=2,ep={gpus},etp=1,sp=1,bf16,distopt"
    assert mega.distributed_optimizer and dict(mega.shape)["num_layers"] == layers
    from megatron_qrl.rollout.fleet_layout import fleet_layout

    fleet_layout(gpus, 1, 1, "sglang", "colocated", trainer_gpus=gpus,
                 mem_fraction=ro.sglang.mem_fraction)  # the FleetSession's check, passes


def test_issue21_run_refuses_a_layer_count_unlike_the_checkpoint(tmp_path, monkeypatch):
    """The checks are live: --num-layers must agree with the checkpoint's config.json."""
    ckpt = _random_checkpoint_config(tmp_path / "ckpt", 8)
    argv = _captured_args(tmp_path, WRAPPER, {"CKPT": str(ckpt), "LAYERS": "6", "GPUS": "8"})
    with pytest.raises(QrlArgumentError, match="num-layers|num_hidden_layers"):
        _parse_on_h200(argv, monkeypatch, 8)


def test_pipeline_stages_option(tmp_path, monkeypatch):
    """``PP=2``: the script's layout with two pipeline stages, on two nodes' worth of ranks."""
    ckpt = _random_checkpoint_config(tmp_path / "ckpt", 8)
    argv = _captured_args(tmp_path, WRAPPER, {"CKPT": str(ckpt), "LAYERS": "8", "GPUS": "8",
                                              "PP": "2"})
    configs, flags, args, job = _parse_on_h200(argv, monkeypatch, 16)
    assert flags["megatron_layout"] == "tp=2,ep=8,etp=1,sp=1,pp=2,bf16,distopt"
    assert configs["megatron"].layout().pp == 2 and args.world_size == 16
    with pytest.raises(QrlArgumentError, match="--pipeline-model-parallel-size 2 .*divisible"):
        _parse_on_h200(argv, monkeypatch, 8)  # one node cannot hold EP 8 x PP 2
