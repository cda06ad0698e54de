"""Megatron-LM flags after ``--`` in qrl-train: parsing, mapping onto the run, and errors.

No process group is started: ``parse_configs`` and ``prepare_job`` are pure.
"""

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import torch

from megatron_qrl.config import QrlArgumentError
from megatron_qrl.config.megatron_flags import FLAGS, MegatronSettings, parse_megatron_flags
from megatron_qrl.data import CharTokenizer
from megatron_qrl.models.hf_config import arch_from_dict
from megatron_qrl.rl.batch import pack_samples, pad_to_multiple
from megatron_qrl.rl.cli import parse_configs
from megatron_qrl.rl.driver import prepare_job
from tests.helpers import RL_RUN_HELPER
from tests.helpers.tiny_hf import make_tiny_hf

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--qrl-preset", "tiny-cpu"]


def _parse(*megatron: str, qrl: tuple[str, ...] = ()):
    return parse_configs([*BASE, *qrl, "--", *megatron])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    hf = make_tiny_hf(tmp_path_factory.mktemp("hf") / "moe", "moe")
    CharTokenizer().save(hf, hf=False)
    return hf


def test_run_flags_become_qrl_values():
    configs, flags, _ = _parse("--lr", "2e-5", "--min-lr", "2e-5", "--seed", "7",
                               "--micro-batch-size", "2", "--train-iters", "5", "--save", "o/x",
                               "--save-interval", "3", "--global-batch-size", "16")
    run = configs["run"]
    assert (run.lr, run.seed, run.micro_batch_size, run.steps) == (2e-5, 7, 2, 5)
    assert (run.output_dir, run.save_interval) == ("o/x", 3)
    # tiny-cpu: 2 updates per step, 8 samples per prompt -> 16 * 2 / 8 prompts
    assert run.prompts_per_step == 4
    assert flags["qrl_lr"] == 2e-5 and flags["megatron_layout"] == "tp=1,ep=1,etp=1,sp=0"
    # an explicit --qrl-* flag that agrees is fine; with 1 update per step the global batch
    # (samples per optimizer step) of 16 is the whole rollout batch of 2 prompts x 8
    configs, _, _ = _parse("--lr", "1e-3", "--global-batch-size", "16", "--micro-batch-size",
                           "8", qrl=("--qrl-lr", "1e-3", "--qrl-updates-per-step", "1"))
    assert configs["run"].prompts_per_step == 2


def test_load_maps_to_checkpoint_model(hf_dir):
    configs, _, _ = _parse("--load", str(hf_dir))
    assert configs["run"].model == "checkpoint" and configs["run"].checkpoint == str(hf_dir)


@pytest.mark.parametrize("qrl, megatron, names", [
    (("--qrl-lr", "1e-3"), ("--lr", "1e-5"), ("--lr", "--qrl-lr")),
    (("--qrl-seed", "3"), ("--seed", "4"), ("--seed", "--qrl-seed")),
    (("--qrl-steps", "3"), ("--train-iters", "4"), ("--train-iters", "--qrl-steps")),
    (("--qrl-model", "tiny-dense"), ("--load", "x"), ("--load", "--qrl-model")),
    (("--qrl-output-dir", "a"), ("--save", "b"), ("--save", "--qrl-output-dir")),
    (("--qrl-prompts-per-step", "3"), ("--global-batch-size", "16"),
     ("--global-batch-size", "--qrl-prompts-per-step")),
])
def test_qrl_and_megatron_flag_disagree(qrl, megatron, names):
    with pytest.raises(QrlArgumentError) as info:
        _parse(*megatron, qrl=qrl)
    for name in names:
        assert name in str(info.value)


@pytest.mark.parametrize("argv, needle", [
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
     "--num-layers-per-virtual-pipeline-stage 1: qrl-train runs megatron-core's non-interleaved"),
    (["--fp16"], "--fp16"),
    (["--optimizer-cpu-offload"], "--use-distributed-optimizer"),
    (["--moe-token-dispatcher-type", "flex"], "DeepEP"),
    (["--normalization", "LayerNorm"], "RMSNorm"),
    (["--position-embedding-type", "learned_absolute"], "rope"),
    (["--num-query-groups", "2"], "--group-query-attention"),
    (["--lr", "1e-5", "--min-lr", "1e-6"], "--min-lr"),
    (["--min-lr", "0"], "--min-lr needs --lr"),
    (["--global-batch-size", "5"], "--global-batch-size 5"),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be >= 1"),
    (["--no-such-flag", "1"], "--tensor-model-parallel-size --pipeline"),
])
def test_refused_flags_name_themselves(argv, needle):
    with pytest.raises(QrlArgumentError, match=None) as info:
        _parse(*argv)
    assert needle in str(info.value)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                    reason="Transformer Engine is installed: these flags are then honoured")
@pytest.mark.parametrize("argv", [["--moe-grouped-gemm"],
                                  ["--moe-token-dispatcher-type", "alltoall"]])
def test_te_only_flags_without_te(argv):
    with pytest.raises(QrlArgumentError, match="Transformer Engine"):
        _parse(*argv)


def test_layout_and_world_checks():
    settings, _, _ = parse_megatron_flags(["--tensor-model-parallel-size", "2"])
    assert (settings.tp, settings.ep, settings.etp) == (2, 1, 2)  # Megatron: ETP defaults to TP
    settings, _, _ = parse_megatron_flags(["--tensor-model-parallel-size", "2",
                                           "--expert-model-parallel-size", "2",
                                           "--expert-tensor-parallel-size", "1",
                                           "--sequence-parallel"])
    assert settings.layout().sequence_parallel and settings.model_parallel_size == 2
    settings.check_world(2)
    settings.check_world(4)
    with pytest.raises(QrlArgumentError, match="torchrun --nproc-per-node 2"):
        settings.check_world(1)
    with pytest.raises(QrlArgumentError, match="torchrun --nproc-per-node 2"):
        settings.check_world(3)


def test_tiny_model_shape_overrides():
    configs, _, _ = _parse("--num-layers", "3", "--group-query-attention",
                           "--num-query-groups", "2", "--moe-router-topk", "3",
                           "--rotary-base", "500", "--qk-layernorm", "--swiglu")
    data = prepare_job(configs)
    assert (data.arch.num_layers, data.arch.num_kv_heads, data.arch.moe_top_k) == (3, 2, 3)
    assert data.arch.rope_theta == 500.0 and data.hf_config["num_hidden_layers"] == 3
    with pytest.raises(QrlArgumentError, match="--num-experts is a MoE flag"):
        prepare_job(_parse("--num-experts", "4", qrl=("--qrl-model", "tiny-dense",
                                                      "--qrl-routing-replay", "off"))[0])
    with pytest.raises(QrlArgumentError, match="--vocab-size 200 disagrees"):
        prepare_job(_parse("--vocab-size", "200")[0])


def test_tiny_model_layout_errors(monkeypatch):
    with pytest.raises(QrlArgumentError, match="torchrun --nproc-per-node 2"):
        _parse("--tensor-model-parallel-size", "2")  # one process cannot hold TP 2
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun --nproc-per-node 2
    with pytest.raises(QrlArgumentError, match="--num-query-groups 2"):  # 1 KV head, TP 2
        prepare_job(_parse("--tensor-model-parallel-size", "2", "--sequence-parallel")[0])
    with pytest.raises(QrlArgumentError, match="--sequence-parallel"):  # MoE x TP needs SP
        prepare_job(_parse("--tensor-model-parallel-size", "2", "--group-query-attention",
                           "--num-query-groups", "2")[0])
    with pytest.raises(QrlArgumentError, match="--expert-model-parallel-size 3"):
        prepare_job(_parse("--expert-model-parallel-size", "3")[0])


def test_checkpoint_shape_must_agree(hf_dir, tmp_path):
    cfg = json.loads((hf_dir / "config.json").read_text())
    agree = ["--load", str(hf_dir), "--hidden-size", str(cfg["hidden_size"]),
             "--num-experts", "8", "--make-vocab-size-divisible-by", "64",
             "--untie-embeddings-and-output-weights", "--norm-epsilon", "1e-6"]
    assert prepare_job(_parse(*agree)[0]).arch.hidden_size == cfg["hidden_size"]
    with pytest.raises(QrlArgumentError, match=r"--hidden-size 128 disagrees with --qrl-checkpoint"):
        prepare_job(_parse("--load", str(hf_dir), "--hidden-size", "128")[0])
    with pytest.raises(QrlArgumentError, match="--make-vocab-size-divisible-by 256"):
        prepare_job(_parse("--load", str(hf_dir), "--make-vocab-size-divisible-by", "256")[0])
    tied = make_tiny_hf(tmp_path / "tied", "dense", tie_word_embeddings=True)
    CharTokenizer().save(tied, hf=False)
    with pytest.raises(QrlArgumentError, match="--untie-embeddings-and-output-weights"):
        prepare_job(_parse("--load", str(tied), "--untie-embeddings-and-output-weights",
                           qrl=("--qrl-routing-replay", "off"))[0])


def _bash_array(script: str, name: str) -> list[str]:
    out = subprocess.run(["bash", "-c", f'source "{script}"; printf "%s\\n" "${{{name}[@]}}"'],
                         capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def test_example_model_flags_parse_and_match_their_model():
    names = {f[0] for f in FLAGS}
    for script in sorted((ROOT / "examples" / "models").glob("*.sh")):
        argv = _bash_array(str(script), "MODEL_ARGS")
        assert {a for a in argv if a.startswith("--")} <= names, script.name
        settings, _, _ = parse_megatron_flags([a for a in argv if a not in (
            "--moe-grouped-gemm", "--moe-permute-fusion", "--moe-router-fusion")] + [
                "--moe-token-dispatcher-type", "allgather"])
        if script.name == "qwen3_30b_a3b.sh":
            cfg = json.loads((ROOT / "megatron_qrl/data/configs/qwen3_30b_a3b.json").read_text())
            settings.apply_to_hf_config(cfg, arch_from_dict(cfg), script.name, fixed_model=True)
        if script.name == "tiny_qwen3_moe.sh":
            from megatron_qrl.data import tiny_moe_config

            cfg = tiny_moe_config(CharTokenizer().vocab_size)
            settings.apply_to_hf_config(cfg, arch_from_dict(cfg), script.name, fixed_model=True)
    for script in ("run_qwen3_4b_1gpu.sh", "run_qwen3_30b_a3b.sh"):
        text = (ROOT / "examples" / script).read_text()
        assert "PARALLEL_ARGS=(" in text
        block = text.split("PARALLEL_ARGS=(")[1].split(")")[0].split()
        assert {a for a in block if a.startswith("--")} <= names, script


def test_default_settings_change_nothing():
    configs, flags, _ = parse_configs(BASE)
    assert configs["megatron"] == MegatronSettings()
    plain = prepare_job(configs)
    assert plain.arch.num_layers == 2 and plain.arch.num_kv_heads == 1


def test_pad_to_multiple_keeps_real_positions():
    batch = pack_samples([[1, 2], [3]], [[4, 5], [6]], [torch.tensor([-0.5, -0.25]),
                                                        torch.tensor([-1.0])], pad_id=0,
                         routed_experts=torch.zeros(2, 4, 1, 2, dtype=torch.long))
    assert batch["tokens"].shape == (2, 4)
    assert pad_to_multiple(batch, 2) is batch  # already a multiple
    out = pad_to_multiple(batch, 3)
    assert out["tokens"].shape == (2, 6)
    for key in ("tokens", "labels", "loss_mask", "rollout_log_probs", "routed_experts"):
        assert torch.equal(out[key][:, :4], batch[key]), key
    assert not out["loss_mask"][:, 4:].any() and (out["routed_experts"][:, 4:] == -1).all()
    assert out["position_ids"][1].tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None,
                    reason="megatron.training (Megatron-LM) is not installed; megatron-core "
                           "alone ships no training-argument parser, the built-in subset is used")
def test_upstream_parser_is_used_when_installed():  # pragma: no cover
    from megatron_qrl.config.megatron_flags import megatron_parser

    parser, upstream = megatron_parser()
    assert upstream
    assert parser.parse_known_args(["--tensor-model-parallel-size", "2"])[0] \
        .tensor_model_parallel_size == 2


def _one_process_job(out: Path, *megatron: str, resume: bool = False
                     ) -> subprocess.CompletedProcess:
    import os
    import sys

    helper = RL_RUN_HELPER
    job = ["--qrl-preset", "tiny-cpu", "--qrl-sft-steps", "1", "--qrl-prompts-per-step", "2",
           "--qrl-rollout-n-samples-per-prompt", "4", "--qrl-rollout-max-new-tokens", "4",
           "--qrl-micro-batch-size", "4", "--qrl-no-progress", "--qrl-output-dir", str(out)]
    job += ["--qrl-resume"] if resume else []
    return subprocess.run([sys.executable, str(helper), *job, "--", *megatron],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.slow
def test_seq_length_tensorboard_dir_and_bf16_act(tmp_path):
    short = _one_process_job(tmp_path / "short", "--train-iters", "1", "--seq-length", "5")
    assert short.returncode == 2 and "more than --seq-length 5" in short.stderr
    board = tmp_path / "tb"
    full = _one_process_job(tmp_path / "full", "--train-iters", "2", "--seq-length", "64",
                            "--bf16", "--save-interval", "1", "--tensorboard-dir", str(board))
    assert full.returncode == 0, full.stderr[-3000:]
    rl = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    if importlib.util.find_spec("tensorboard") is not None:  # --tensorboard-dir is honoured
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(board))
        events.Reload()
        assert [s.value for s in events.Scalars("reward_mean")] == pytest.approx(
            [r["reward_mean"] for r in rl if r["phase"] == "rl"], abs=1e-6)
    # --bf16: BF16 parameters, fp32 masters; a resumed run continues exactly
    part = tmp_path / "part"
    assert _one_process_job(part, "--train-iters", "1", "--bf16", "--save-interval", "1") \
        .returncode == 0
    again = _one_process_job(part, "--train-iters", "2", "--bf16", "--save-interval", "1",
                             resume=True)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]
    timing = ("time_rollout_s", "time_recompute_s", "time_train_s", "time_sync_s", "time_step_s")
    assert {k: v for k, v in resumed[-1].items() if k not in timing} == \
        {k: v for k, v in rl[-1].items() if k not in timing}
    state = torch.load(part / "checkpoints" / "step_000003.pt", weights_only=False)
    assert state["trainer"]["model"]["embedding.word_embeddings.weight"].dtype == torch.bfloat16
    assert state["flags"]["megatron_layout"].endswith(",bf16")


def test_flags_known_only_to_a_larger_upstream_parser_are_refused(monkeypatch):
    from megatron_qrl.config import megatron_flags

    built = megatron_flags.megatron_parser

    def upstream():  # a stand-in for Megatron-LM's parser: the subset plus one more flag
        parser, _ = built()
        parser.add_argument("--overlap-grad-reduce", action="store_true")
        return parser, True

    monkeypatch.setattr(megatron_flags, "megatron_parser", upstream)
    settings, _, _ = parse_megatron_flags(["--tensor-model-parallel-size", "2"])
    assert settings.tp == 2
    with pytest.raises(QrlArgumentError, match="overlap_grad_reduce .* no effect"):
        parse_megatron_flags(["--overlap-grad-reduce"])
