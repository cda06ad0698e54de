"""tools/ answer a user's mistake or a damaged file with ONE line and exit code 2.

Each case used to end in a raw traceback, a misleading message or silence. ``--debug`` (or
``QRL_DEBUG=1``) brings the traceback back.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

from tests.tools.test_tools_safety import run
from tools import convert_hf_to_megatron as to_megatron
from tools import convert_megatron_to_hf as to_hf
from tools import export_quantized as export_tool
from tools import mismatch_report


def one_line(code: int, err: str, *needles: str) -> None:
    """Exit code 2, no traceback, the last stderr line is ``TOOL: error: ...`` with ``needles``."""
    assert code == 2, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert "error:" in last and all(n in last for n in needles), err


@pytest.fixture(scope="module")
def megatron_dir(dense_hf, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mg") / "mg"
    assert to_megatron.main(["--hf-dir", str(dense_hf), "--out", str(out)]) == 0
    return out


@pytest.fixture
def hf(tmp_path, dense_hf) -> Path:
    return Path(shutil.copytree(dense_hf, tmp_path / "hf"))


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_damaged_safetensors(hf, tmp_path, capsys, damage):
    f = hf / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncated": data[: len(data) // 2], "empty": b"",
                   "garbage": b"\xff" * 64 + data[64:]}[damage])
    for tool, argv in [(export_tool, ["--format", "int8", "--out", str(tmp_path / "o")]),
                       (to_megatron, ["--out", str(tmp_path / "o")])]:
        code, err = run(tool, ["--hf-dir", str(hf), *argv], capsys)
        one_line(code, err, f"{f}: not a readable safetensors file", "truncated or corrupted")
    assert not (tmp_path / "o").exists()


def test_malformed_config_and_index(hf, tmp_path, capsys):
    (hf / "model.safetensors.index.json").write_text("{not json")
    code, err = run(export_tool, ["--hf-dir", str(hf), "--format", "int8", "--out",
                                  str(tmp_path / "o")], capsys)
    one_line(code, err, "model.safetensors.index.json: not a safetensors index")
    (hf / "config.json").write_text('{"architectures": ')
    code, err = run(export_tool, ["--hf-dir", str(hf), "--format", "int8", "--out",
                                  str(tmp_path / "o")], capsys)
    one_line(code, err, f"{hf / 'config.json'}: not valid JSON")


@pytest.mark.parametrize("damage", ["truncated_shard", "flipped_shard", "truncated_metadata",
                                    "other_model"])
def test_damaged_megatron_checkpoint(megatron_dir, tmp_path, capsys, damage):
    mg = Path(shutil.copytree(megatron_dir, tmp_path / "mg"))
    shard = sorted((mg / "model").glob("*.distcp"))[0]
    data = shard.read_bytes()
    if damage == "truncated_shard":
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "flipped_shard":
        shard.write_bytes(bytes(b ^ 0xFF for b in data[:512]) + data[512:])
    elif damage == "truncated_metadata":
        meta = mg / "model" / ".metadata"
        meta.write_bytes(meta.read_bytes()[:100])
    else:  # a CheckpointMismatch: the travelling config.json says another shape
        cfg = json.loads((mg / "hf" / "config.json").read_text())
        (mg / "hf" / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 80}))
    code, err = run(to_hf, ["--megatron-dir", str(mg), "--out", str(tmp_path / "back")], capsys)
    one_line(code, err, f"{mg / 'model'}: the checkpoint shards cannot be read")
    assert not (tmp_path / "back").exists() and not list(tmp_path.glob(".back.*"))


@pytest.mark.parametrize("code_, words", [
    (errno.ENOSPC, ("no space left on", "free", "or choose another --out")),
    (errno.EROFS, (os.strerror(errno.EROFS), "read-only")),
    (errno.EACCES, (os.strerror(errno.EACCES), "permission denied"))])
def test_full_or_read_only_output_disk(hf, tmp_path, capsys, monkeypatch, code_, words):
    from megatron_qrl.models import hf_io

    def fail(tensors, path, metadata=None):
        raise OSError(code_, os.strerror(code_), path)

    monkeypatch.setattr(hf_io, "save_file", fail)
    code, err = run(export_tool, ["--hf-dir", str(hf), "--format", "int8", "--out",
                                  str(tmp_path / "o")], capsys)
    one_line(code, err, *words)
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.tmp-*"))


def test_full_disk_while_saving_a_megatron_checkpoint(hf, tmp_path, capsys, monkeypatch):
    """The .distcp writer reports a full disk as text inside a CheckpointException."""
    import megatron.core.dist_checkpointing.strategies.filesystem_async as writer
    import torch.distributed.checkpoint.filesystem as torch_writer

    def fail(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "shard.distcp"))

    monkeypatch.setattr(writer, "_write_item", fail)
    monkeypatch.setattr(torch_writer, "_write_item", fail)
    code, err = run(to_megatron, ["--hf-dir", str(hf), "--out", str(tmp_path / "mg")], capsys)
    one_line(code, err, f"no space left on {tmp_path / 'mg'}", "or choose another --out")
    assert not (tmp_path / "mg").exists() and not list(tmp_path.glob(".mg.tmp-*"))


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1", "-1e-3"])
def test_max_shard_gb_must_be_positive(hf, tmp_path, capsys, value):
    code, err = run(export_tool, ["--hf-dir", str(hf), "--format", "int8", "--out",
                                  str(tmp_path / "o"), "--max-shard-gb", value], capsys)
    one_line(code, err, "--max-shard-gb", "must be a finite number > 0")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv, needles", [
    (["--batch", "0"], ("--batch", "must be an integer >= 1")),
    (["--seq-len", "-4"], ("--seq-len", "must be an integer >= 1")),
])
def test_mismatch_report_counts(hf, tmp_path, capsys, argv, needles):
    code, err = run(mismatch_report, ["--hf-dir", str(hf), "--format", "int8", "--out",
                                      str(tmp_path / "r.png"), *argv], capsys)
    one_line(code, err, *needles)


@pytest.mark.parametrize("value", ["-1e-3", "-2.5", "nan", "-inf"])
def test_negative_and_nan_values_are_read_and_refused(hf, tmp_path, capsys, value):
    """``--uaq-scale -1e-3`` was ``expected one argument`` (argparse took it for a flag)."""
    code, err = run(to_megatron, ["--hf-dir", str(hf), "--out", str(tmp_path / "o"),
                                  "--uaq-scale", value], capsys)
    one_line(code, err, "--uaq-scale", f"must be a finite number > 0, got '{value}'")


def test_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    argv = ["--hf-dir", str(tmp_path / "missing"), "--format", "int8", "--out", str(tmp_path / "o")]
    code, err = run(export_tool, argv, capsys)
    one_line(code, err, "config.json not found")
    code, err = run(export_tool, [*argv, "--debug"], capsys)
    assert code == 2 and "Traceback" in err and "config.json not found" in err.splitlines()[-1]
    monkeypatch.setenv("QRL_DEBUG", "1")
    code, err = run(export_tool, argv, capsys)
    assert code == 2 and "Traceback" in err


def test_run_tool_keeps_its_api_and_a_bug_keeps_its_traceback(capsys):
    from megatron_qrl.utils.cli import run_tool

    assert run_tool("t", lambda: Path("x")) == 0 and "wrote x" in capsys.readouterr().out
    assert run_tool("t", lambda: (_ for _ in ()).throw(KeyError("k: not found"))) == 2
    assert capsys.readouterr().err == "t: error: k: not found\n"
    with pytest.raises(ZeroDivisionError):
        run_tool("t", lambda: 1 / 0)


@pytest.mark.parametrize("line", ['{"text": "no prompt field"}', '{"prompt": "unterminated'])
def test_mismatch_report_malformed_prompts(hf, tmp_path, capsys, line):
    from megatron_qrl.data import CharTokenizer

    CharTokenizer().save(hf, hf=True)  # a tokenizer, so the prompts file is read
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1="}\n' + line + "\n")
    code, err = run(mismatch_report, ["--hf-dir", str(hf), "--format", "int8", "--out",
                                      str(tmp_path / "r.png"), "--batch", "2",
                                      "--prompts", str(prompts)], capsys)
    one_line(code, err, f"--prompts {prompts}: prompt 2 is a JSON line without a string 'prompt'")


@pytest.mark.parametrize("override, key, fields", [
    ({"num_hidden_layers": 0}, "num_hidden_layers must be > 0", ("num_hidden_layers",)),
    ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3",
     ("num_attention_heads", "num_key_value_heads")),
])
def test_unsupported_config_names_the_config_key(hf, tmp_path, capsys, override, key, fields):
    """The message names config.json's key (not ModelArch's); ``fields`` lets a caller that
    set the key from a Megatron flag name the flag."""
    from megatron_qrl.models.hf_config import UnsupportedModelError, arch_from_dict

    cfg = {**json.loads((hf / "config.json").read_text()), **override}
    (hf / "config.json").write_text(json.dumps(cfg))
    code, err = run(export_tool, ["--hf-dir", str(hf), "--format", "int8", "--out",
                                  str(tmp_path / "o")], capsys)
    one_line(code, err, key)
    with pytest.raises(UnsupportedModelError) as info:
        arch_from_dict(cfg)
    assert getattr(info.value, "fields", None) == fields
