"""A checkpoint saved on pipeline stages converts to HF like the one-stage checkpoint.

tools/merge_lora.py (a LoRA run's checkpoint -> merged HF checkpoint + PEFT adapter) reads a
pipeline-parallel run's checkpoint by joining its stages' states
(``rl.checkpoint.model_state_of`` -> ``models.stages.whole_model_state``). The states are the
trainer's own: the tiny dense LoRA model built on PP 2 (gloo, one layer a stage) and on one
process from the same HF weights and adapters, frozen into the LoRA phase
(``rl.lora_sync.enter_lora``), saved as driver checkpoints. Both must give the same files, byte
for byte: joining stages renames tensors and does no arithmetic, so tolerance 0. On the code
before the join, merge_lora read rank 0's state (stage 0 only) and refused the PP checkpoint
("checkpoint does not match the model: missing ...").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.mp_utils import run_distributed
from tests.rl.test_pipeline_parity import _hf_weights, _set_adapters

FLAGS = ["--qrl-model", "tiny-dense", "--qrl-routing-replay", "off", "--qrl-train-forward",
         "bf16", "--qrl-rollout-format", "bf16", "--qrl-lora-rank", "4", "--qrl-sft-steps", "0"]
PP2 = "tp=1,ep=1,etp=1,sp=0,pp=2"


def _state(rank, world_size, port, pp: int) -> dict:
    """This rank's trainer state of the LoRA model (PP ``pp``), weights from ``_hf_weights``."""
    from megatron_qrl.compat import cpu_device_mode, destroy_cpu_distributed, init_cpu_distributed
    from megatron_qrl.models.builder import ParallelLayout
    from megatron_qrl.models.streaming import groups_from_parallel_state, load_hf_weights
    from megatron_qrl.rl.cli import parse_configs
    from megatron_qrl.rl.driver import prepare_job
    from megatron_qrl.rl.forward import forward_plan
    from megatron_qrl.rl.lora_sync import enter_lora
    from megatron_qrl.rl.trainer import PolicyTrainer, build_policy

    init_cpu_distributed(rank, world_size, port, pp=pp, seed=0)
    try:
        with cpu_device_mode():
            configs = parse_configs(FLAGS)[0]
            arch = prepare_job(configs).arch
            groups = groups_from_parallel_state(arch.num_layers) if pp > 1 else None
            trainer = PolicyTrainer(build_policy(
                arch, 1e-3, forward_plan(configs, arch),
                layout=ParallelLayout(pp=pp) if pp > 1 else None, groups=groups))
            load_hf_weights(trainer.module, arch, _hf_weights(arch).__getitem__, groups)
            enter_lora(trainer, configs)
            _set_adapters(trainer.module, None if groups is None else groups.stage)
            return trainer.state_dict()
    finally:
        destroy_cpu_distributed()


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.mark.slow
def test_pp2_checkpoint_merges_to_the_pp1_files(tmp_path):
    from megatron_qrl.models.hf_io import open_hf_checkpoint
    from megatron_qrl.rl.checkpoint import save_driver_checkpoint
    from megatron_qrl.rl.cli import parse_configs
    from megatron_qrl.rl.driver import prepare_job
    from tools import merge_lora

    configs, flags, _ = parse_configs(FLAGS)
    data = prepare_job(configs)
    (one,) = run_distributed(_state, 1, 1)
    two = run_distributed(_state, 2, 2)
    assert "decoder.layers.1.self_attention.linear_qkv.weight" not in two[0]["model"] | \
        two[1]["model"]  # each stage holds its layer as its layers.0
    save_driver_checkpoint(tmp_path / "pp1", 3, one, flags, model_config=data.hf_config)
    save_driver_checkpoint(tmp_path / "pp2", 3, two[0], dict(flags, megatron_layout=PP2),
                           rank_states=two, model_config=data.hf_config)
    got = {}
    for run in ("pp1", "pp2"):
        merge_lora.merge_run(tmp_path / run, tmp_path / f"{run}-hf",
                             adapter_out=tmp_path / f"{run}-peft")
        got[run] = (_files(tmp_path / f"{run}-hf"), _files(tmp_path / f"{run}-peft"))
    assert got["pp2"] == got["pp1"]
    assert any(n.endswith(".safetensors") for n in got["pp1"][0])
    # the files hold the merged policy: adapted weights moved, the rest as loaded
    _, _, reader = open_hf_checkpoint(tmp_path / "pp2-hf")
    loaded = _hf_weights(data.arch)
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        assert not torch.equal(reader.get(name), loaded[name]), name
    torch.testing.assert_close(reader.get("model.layers.1.input_layernorm.weight"),
                               loaded["model.layers.1.input_layernorm.weight"], rtol=0, atol=0)


def test_whole_model_state_joins_stages():
    from megatron_qrl.models.stages import whole_model_state

    emb, a, b, norm = (torch.full((2,), float(i)) for i in range(4))
    stages = [{"embedding.word_embeddings.weight": emb, "decoder.layers.0.x": a},
              {"decoder.layers.0.x": b, "output_layer.weight": emb.clone(),
               "decoder.final_layernorm.weight": norm}]
    assert whole_model_state(stages, 2, tied=True) == {
        "embedding.word_embeddings.weight": emb, "decoder.layers.0.x": a,
        "decoder.layers.1.x": b, "decoder.final_layernorm.weight": norm}
    assert "output_layer.weight" in whole_model_state(stages, 2, tied=False)
    stages[1]["output_layer.weight"] = emb + 1  # a tied copy that drifted
    with pytest.raises(ValueError, match="stage 1's output_layer.weight differs"):
        whole_model_state(stages, 2, tied=True)


def test_tensor_parallel_checkpoint_is_refused_by_layout():
    from megatron_qrl.rl.checkpoint import model_state_of

    state = {"rank_states": [{"model": {}}] * 4, "trainer": {},
             "flags": {"megatron_layout": "tp=2,ep=1,etp=2,sp=0,pp=2"}}
    with pytest.raises(ValueError, match=r"ckpt.pt: written by a run with tp=2, etp=2 .*"
                                         "--tensor-model-parallel-size 1"):
        model_state_of(state, "ckpt.pt", None)
