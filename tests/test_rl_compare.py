"""--qrl-compare: the variant command lines (every variant validates) and the aligned note."""

from pathlib import Path

import pytest

from megatron_qrl.rl.cli import parse_configs
from megatron_qrl.rl.compare import VARIANTS, variant_argv

BASE = ["--qrl-preset", "tiny-cpu", "--qrl-routing-replay", "off", "--qrl-steps", "7"]


@pytest.mark.parametrize("have_aligned", [True, False])
def test_every_variant_is_a_valid_run(have_aligned, tmp_path):
    labels = [label for label, _ in VARIANTS]
    assert labels == ["bf16", "int8+naive_quant", "int8+tis", "int8+acr", "int8 aligned+tbpo",
                      "nvfp4 aligned+tbpo"]
    for label, extra in VARIANTS:
        argv, note = variant_argv(BASE, extra, tmp_path / "v", have_aligned)
        configs, flags, _ = parse_configs(argv)
        fmt, kind = label.split(" ")[0].split("+")[0], configs["loss"].kind
        assert configs["rollout"].format == fmt
        assert kind in label or (label == "bf16" and kind == "ppo_clip")
        assert configs["run"].sft_steps == 0 and configs["run"].steps == 7
        assert Path(configs["run"].output_dir) == tmp_path / "v"
        aligned = "aligned" in label
        assert configs["train"].forward == ("aligned" if aligned and have_aligned else "bf16")
        assert bool(note) == (aligned and not have_aligned)
