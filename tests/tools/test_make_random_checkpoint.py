"""tools/make_random_checkpoint.py: a random HF checkpoint qrl-train can start from (CPU, tiny)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "make_random_checkpoint.py"
TINY_MOE = ROOT / "megatron_qrl" / "data" / "configs" / "tiny_qwen3_moe.json"

sys.path.insert(0, str(ROOT / "tools"))
from make_random_checkpoint import load_config, make_random_checkpoint  # noqa: E402


def test_builtin_configs_and_layers():
    cfg = load_config("qwen3_30b_a3b", 3)
    assert cfg["num_hidden_layers"] == 3 and cfg["num_experts"] == 128
    four = load_config("qwen3_4b", None)
    assert (four["hidden_size"], four["num_hidden_layers"], four["tie_word_embeddings"]) == (
        2560, 36, True)
    with pytest.raises(FileNotFoundError, match="--config"):
        load_config("nope.json", None)
    with pytest.raises(ValueError, match="--layers"):
        load_config("qwen3_4b", 0)


def test_tiny_checkpoint_loads_into_qrl_train_and_is_deterministic(tmp_path):
    from megatron_qrl.models.hf_io import HFCheckpointReader
    from megatron_qrl.rl.start_model import load_tokenizer, read_start_checkpoint

    out = make_random_checkpoint(str(TINY_MOE), tmp_path / "ckpt", layers=1, seed=3,
                                 shard_gb=0.0001)  # several shards + index
    start = read_start_checkpoint(out)
    assert start.arch.num_layers == 1 and start.arch.is_moe
    reader = HFCheckpointReader(out)
    reader.check_against(start.arch)  # every tensor of the config, right shapes
    assert len(list(out.glob("*.safetensors"))) > 1
    tok = load_tokenizer(out)
    assert tok.vocab_size <= start.arch.vocab_size
    for name in ("config.json", "generation_config.json"):  # the ids of the tokenizer shipped
        ids = json.loads((out / name).read_text())
        assert (ids["bos_token_id"], ids["eos_token_id"]) == (tok.bos_id, tok.eos_id), name
    again = make_random_checkpoint(str(TINY_MOE), tmp_path / "again", layers=1, seed=3)
    from safetensors.torch import load_file

    def tensors(d: Path) -> dict:
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}

    a, b = tensors(out), tensors(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    norm = a["model.layers.0.input_layernorm.weight"].float()
    assert 0.9 < norm.mean() < 1.1 and norm.std() > 0  # gains near 1, not all equal
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="--overwrite"):
        make_random_checkpoint(str(TINY_MOE), out, layers=1)
    make_random_checkpoint(str(TINY_MOE), out, layers=2, overwrite=True)  # its own output
    assert read_start_checkpoint(out).arch.num_layers == 2


def test_cli_errors_are_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(TOOL), "--config", "missing.json", "--out",
                           str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "make_random_checkpoint: error: --config" in proc.stderr
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    proc = subprocess.run([sys.executable, str(TOOL), "--config", str(TINY_MOE), "--out",
                           str(tmp_path / "mine"), "--overwrite"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "not an output of make_random_checkpoint" in proc.stderr
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
