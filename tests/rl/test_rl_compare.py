"""--qrl-compare: the variant command lines, seeds, one warm-up per seed, mean/std + bands."""

import math
from pathlib import Path

import pytest
import torch

from megatron_qrl.config import QrlArgumentError
from megatron_qrl.rl.checkpoint import save_driver_checkpoint
from megatron_qrl.rl.cli import _compare_base, _summary, parse_configs
from megatron_qrl.rl.compare import LOW_LR, VARIANTS, parse_seeds, run_compare, variant_argv
from megatron_qrl.rl.compare_report import aggregate, run_columns, table, write_report

BASE = ["--qrl-preset", "tiny-cpu", "--qrl-routing-replay", "off", "--qrl-steps", "7"]


def test_every_variant_is_a_valid_run(tmp_path):
    for label, extra in VARIANTS:
        configs, _, _ = parse_configs(variant_argv(BASE, extra, tmp_path / "v"))
        fmt, kind = configs["rollout"].format, configs["loss"].kind
        assert label.startswith(fmt)
        assert kind in label or {"bf16": "ppo_clip", "w4a16 naive": "naive_quant",
                                 "int8 low-lr": "acr", "int8 low-lr+uaq": "acr"}[label] == kind
        assert configs["run"].sft_steps == 0 and configs["run"].steps == 7
        assert Path(configs["run"].output_dir) == tmp_path / "v"
        assert configs["train"].forward == ("aligned" if "aligned" in label else "bf16")
        assert configs["aqn"].enabled == label.endswith("aqn")
        assert configs["uaq"].enabled == label.endswith("uaq")
        assert (configs["run"].lr == LOW_LR) == ("low-lr" in label)
        assert configs["lora"].enabled == ("lora" in label)


@pytest.mark.parametrize("label, rank, alpha, base, dropout, lr", [
    ("bf16 lora ppo_clip", 32, 32.0, "bf16", 0.0, None),
    ("bf16 qlora-nf4 ppo_clip", 8, 16.0, "nf4", 0.05, 1e-4),
    ("nvfp4 lora aligned+tis+aqn", 32, 32.0, "nvfp4", 0.0, None),
])
def test_lora_variants_carry_the_papers_settings(tmp_path, label, rank, alpha, base, dropout, lr):
    extra = dict(VARIANTS)[label]
    configs, _, _ = parse_configs(variant_argv(BASE, extra, tmp_path / "v"))
    lora = configs["lora"]
    assert (lora.rank, lora.alpha, lora.base_format, lora.dropout) == (rank, alpha, base, dropout)
    base_lr = parse_configs(BASE)[0]["run"].lr
    assert configs["run"].lr == (lr if lr is not None else base_lr)


def test_seeds_flag():
    assert parse_seeds("1,2,3") == [1, 2, 3] and parse_seeds(None) == [None]
    for bad in ("1,x", "1,1", "-2"):
        with pytest.raises(QrlArgumentError, match="--qrl-seeds"):
            parse_seeds(bad)
    with pytest.raises(QrlArgumentError, match="--qrl-seeds is for --qrl-compare"):
        parse_configs([*BASE, "--qrl-seeds", "1"])
    with pytest.raises(QrlArgumentError, match="--qrl-seeds '1,1'"):
        parse_configs([*BASE, "--qrl-compare", "--qrl-seeds", "1,1"])
    assert _compare_base([*BASE, "--qrl-compare", "--qrl-seeds", "1,2"]) == BASE
    assert _compare_base([*BASE, "--qrl-seeds=4", "--qrl-compare"]) == BASE


def _rl(acc, **extra):
    return [{"step": i, "phase": "rl", "accuracy": a, "mismatch_kl": 0.01 * i,
             "prox_behav_ratio_max": 1.0 + i, "tis_trunc_frac": 0.0, "clip_frac": 0.1,
             "rollout_nll": 2.0 - 0.1 * i, "entropy": 1.0, **extra} for i, a in enumerate(acc)]


def test_columns_and_seed_aggregation():
    a = [{"step": -1, "phase": "sft", "accuracy": None}] + _rl([0.2] * 10 + [0.5] * 10)
    cols = run_columns(a)
    assert cols["acc first 10"] == pytest.approx(0.2) and cols["acc last 10"] == pytest.approx(0.5)
    assert cols["acc change"] == pytest.approx(0.3)
    assert cols["max ratio"] == 20.0
    assert cols["early rollout NLL"] == pytest.approx(2.0 - 0.1 * 4.5)  # steps 0..9
    runs = {"bf16": {"1": a, "2": _rl([0.3] * 10 + [0.4] * 10)}, "w4a16 naive": {"1": a}}
    agg = aggregate(runs)
    m, s, n = agg["bf16"]["acc change"]
    assert (m, s, n) == (pytest.approx(0.2), pytest.approx(math.sqrt(0.02)), 2)
    assert agg["w4a16 naive"]["acc change"][1:] == (0.0, 1)
    md = table(runs)
    assert "| bf16 | 0.25 ± 0.071 | 0.45 ± 0.071 | 0.2 ± 0.14 |" in md
    assert "| bf16 | +0.300 | +0.100 |" in md and "| w4a16 naive | +0.300 | n/a |" in md


def test_report_writes_table_and_band_plot(tmp_path):
    runs = {"bf16": {"1": _rl([0.1 * i for i in range(6)]), "2": _rl([0.5] * 6)}}
    md, png = write_report(runs, tmp_path)
    assert md.read_text().startswith("mean ± std over 2 seed(s)")
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no runs"):
        write_report({"bf16": {}}, tmp_path)


def test_one_warm_up_per_seed_shared_by_every_variant(tmp_path):
    calls = []

    def parse(argv):
        configs, flags, _ = parse_configs(argv)
        return configs, flags

    def run(configs, flags, start_weights=None, skip_sft=False):
        r = configs["run"]
        calls.append((r.seed, r.steps, skip_sft, start_weights, Path(r.output_dir)))
        if r.steps == 0:  # the warm-up: leave a checkpoint with seed-specific weights
            save_driver_checkpoint(r.output_dir, r.sft_steps,
                                   {"model": {"w": torch.tensor(float(r.seed))}}, flags)
            return []
        return _rl([0.1 * r.seed] * 4)

    variants = VARIANTS[:2]
    md, _ = run_compare([*BASE, "--qrl-sft-steps", "3"], parse, run, tmp_path, log=lambda m: None,
                        seeds=[5, 6], variants=variants)
    warm = [c for c in calls if c[1] == 0]
    assert [c[0] for c in warm] == [5, 6] and not any(c[2] for c in warm)
    rl = [c for c in calls if c[1] == 7]
    assert [(c[0], c[2]) for c in rl] == [(5, True)] * 2 + [(6, True)] * 2
    assert all(float(c[3]["w"]) == c[0] for c in rl)  # each seed's own warm-up weights
    assert [c[4] for c in calls] == [tmp_path / f"seed{s}" / d for s in (5, 6)
                                     for d in ("sft", "bf16", "int8_aligned+acr")]
    assert "mean ± std over 2 seed(s)" in md.read_text()


def test_summary_line_uses_ten_step_windows(capsys):
    recs = [{"phase": "sft", "accuracy": None}] + _rl([0.0] * 5 + [0.4] * 30 + [1.0] * 5)
    _summary(recs)
    out = capsys.readouterr().out
    assert "first 10 steps 0.200" in out and "last 10 steps 0.700" in out


def test_visible_update_fraction_closed_form():
    from megatron_qrl.quant import get_spec
    from megatron_qrl.rl.compare_report import visible_update_fraction

    int8 = get_spec("int8")  # per output row: step = amax / 127
    w = torch.zeros(2, 128)
    w[:, 0] = 1.27  # amax 1.27 -> step 0.01 in both rows
    after = w.clone()
    after[0, 1] = 0.004  # below half a step: rounds to 0, invisible
    after[1, 1] = 0.006  # above half a step: one code up, visible
    after[1, 2] = 0.0001  # invisible
    before_sd = {"decoder.layers.0.self_attention.linear_qkv.weight": w,
                 "decoder.layers.0.input_layernorm.weight": torch.ones(128),
                 "embedding.word_embeddings.weight": torch.zeros(4, 128)}
    after_sd = {**before_sd, "decoder.layers.0.self_attention.linear_qkv.weight": after,
                "embedding.word_embeddings.weight": torch.ones(4, 128)}  # not a linear: skipped
    assert visible_update_fraction(before_sd, after_sd, int8) == pytest.approx(1 / 3)
    # UAQ divides the weight by s (QuRL eq. 10-12): amax and step shrink by s, the update does not
    s = 1.5
    scaled = {k: (v / s if "linear_" in k else v) for k, v in before_sd.items()}
    moved = {k: scaled[k] + (after_sd[k] - before_sd[k]) if "linear_" in k else v
             for k, v in after_sd.items()}
    assert visible_update_fraction(scaled, moved, int8) == pytest.approx(2 / 3)
    assert visible_update_fraction(before_sd, before_sd, int8) is None
    assert visible_update_fraction(before_sd, after_sd, get_spec("bf16")) == 1.0


def test_report_from_seed_dirs(tmp_path):
    from megatron_qrl.rl.compare import report_from_dirs
    from megatron_qrl.utils.metrics import MetricsLogger

    req = {"reward_mean": 0.5, "error_token_rate": 0.0, "time_rollout_s": 0.0,
           "time_train_s": 0.0, "time_sync_s": 0.0}
    for seed, acc in ((1, 0.2), (2, 0.4)):
        for slug in ("bf16", "w4a16_naive"):
            with MetricsLogger(tmp_path / f"run{seed}" / f"seed{seed}" / slug,
                               tensorboard=False) as log:
                for r in _rl([acc] * 4):
                    log.log({**req, **r})
    md, png = report_from_dirs([tmp_path / "run1", tmp_path / "run2"], tmp_path / "all")
    text = md.read_text()
    assert "| bf16 | 0.3 ± 0.14 |" in text and "| w4a16 naive | 0.3 ± 0.14 |" in text
    assert "| seed 1 | seed 2 |" in text and png.is_file()
    with pytest.raises(FileNotFoundError, match="no compare runs"):
        report_from_dirs([tmp_path / "nothing"], tmp_path / "x")
