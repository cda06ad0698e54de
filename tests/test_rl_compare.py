"""--qrl-compare: the variant command lines (every variant validates)."""

from pathlib import Path

from megatron_qrl.rl.cli import parse_configs
from megatron_qrl.rl.compare import VARIANTS, variant_argv

BASE = ["--qrl-preset", "tiny-cpu", "--qrl-routing-replay", "off", "--qrl-steps", "7"]


def test_every_variant_is_a_valid_run(tmp_path):
    labels = [label for label, _ in VARIANTS]
    assert labels == ["bf16", "int8+naive_quant", "int8+tis", "int8+acr", "int8 aligned+tbpo",
                      "nvfp4 aligned+tbpo"]
    for label, extra in VARIANTS:
        argv = variant_argv(BASE, extra, tmp_path / "v")
        configs, flags, _ = parse_configs(argv)
        fmt, kind = label.split(" ")[0].split("+")[0], configs["loss"].kind
        assert configs["rollout"].format == fmt
        assert kind in label or (label == "bf16" and kind == "ppo_clip")
        assert configs["run"].sft_steps == 0 and configs["run"].steps == 7
        assert Path(configs["run"].output_dir) == tmp_path / "v"
        assert configs["train"].forward == ("aligned" if "aligned" in label else "bf16")
