"""tools/ never destroy an input, never misread a quantized export, never carry NaN through.

Every case runs the tool's ``main()`` as a user would and compares the bytes of the inputs
before and after (``export_quantized --overwrite`` once replaced the BF16 source,
delete a parent directory, or replace a plain file).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_qrl.models.export import export_quantized
from tests.helpers.tiny_hf import make_tiny_hf
from tools import convert_hf_to_megatron as to_megatron
from tools import convert_megatron_to_hf as to_hf
from tools import export_quantized as export_tool
from tools import mismatch_report

# every quantized linear's in_features a multiple of 128 (fp8_block, w4a16)
QUANT_DIMS = dict(hidden_size=128, head_dim=128, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=256, moe_intermediate_size=128)
QUANTIZED = ["int8", "fp8", "fp8_block", "w4a16", "nvfp4"]
MARKER_NAME = ".megatron_qrl-output.json"  # the marker every tool output carries (utils/outdir)


def run(tool, argv: list[str], capsys) -> tuple[int, str]:
    """``(exit code, stderr)`` of ``tool.main(argv)`` (argparse errors exit via SystemExit)."""
    try:
        code = tool.main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (or ``root`` itself) with its bytes."""
    if root.is_file():
        return {root.name: root.read_bytes()}
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def quant_hf(tmp_path_factory) -> Path:
    return make_tiny_hf(tmp_path_factory.mktemp("quant") / "moe", "moe", dtype=torch.bfloat16,
                        **QUANT_DIMS)


@pytest.fixture
def workspace(tmp_path, dense_hf) -> dict[str, Path]:
    """A parent directory holding a copy of the model and a file unrelated to it."""
    import shutil

    parent = tmp_path / "models"
    hf = parent / "hf"
    shutil.copytree(dense_hf, hf)
    (parent / "notes.txt").write_text("unrelated work\n")
    (tmp_path / "plain_file").write_text("not a directory\n")
    (tmp_path / "link").symlink_to(hf, target_is_directory=True)
    return {"hf": hf, "parent": parent, "file": tmp_path / "plain_file", "link": tmp_path / "link"}


@pytest.mark.parametrize("out_key, guard, pattern", [
    ("hf", "hf", r"--out .*hf is the input"),             # --out == --hf-dir
    ("link", "hf", r"--out .*link is the input"),         # a symlink to --hf-dir
    ("parent", "parent", r"--out .*models contains the input"),  # a parent with other files
    ("file", "file", r"--out .*plain_file exists and is not a directory"),
])
def test_export_overwrite_never_destroys(workspace, capsys, out_key, guard, pattern):
    before = snapshot(workspace[guard])
    code, err = run(export_tool, ["--hf-dir", str(workspace["hf"]), "--format", "int8",
                                  "--out", str(workspace[out_key]), "--overwrite"], capsys)
    assert code == 2 and re.search(pattern, err), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert snapshot(workspace[guard]) == before
    assert workspace["link"].is_symlink()


def test_overwrite_replaces_only_a_marked_earlier_output(workspace, tmp_path, capsys):
    hf = workspace["hf"]
    out = tmp_path / "q"
    assert run(export_tool, ["--hf-dir", str(hf), "--format", "int8", "--out", str(out)], capsys)[0] == 0
    assert json.loads((out / MARKER_NAME).read_text())["tool"] == "export_quantized"
    code, err = run(export_tool, ["--hf-dir", str(hf), "--format", "fp8", "--out", str(out)], capsys)
    assert code == 2 and "already exists" in err and "--overwrite" in err
    assert run(export_tool, ["--hf-dir", str(hf), "--format", "fp8", "--out", str(out),
                             "--overwrite"], capsys)[0] == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "w8a8_fp8"
    # a directory without the marker, or with another tool's marker, is never replaced
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "results.csv").write_text("1,2,3\n")
    code, err = run(export_tool, ["--hf-dir", str(hf), "--format", "int8", "--out", str(mine),
                                  "--overwrite"], capsys)
    assert code == 2 and f"no {MARKER_NAME}" in err
    assert snapshot(mine) == {"results.csv": b"1,2,3\n"}
    (mine / MARKER_NAME).write_text(json.dumps({"tool": "convert_megatron_to_hf"}))
    code, err = run(export_tool, ["--hf-dir", str(hf), "--format", "int8", "--out", str(mine),
                                  "--overwrite"], capsys)
    assert code == 2 and "written by 'convert_megatron_to_hf'" in err
    assert (mine / "results.csv").is_file()
    assert not list(tmp_path.glob(".*tmp-*")) and not list(tmp_path.glob(".*old-*"))


def _fake_megatron_dir(root: Path, hf: Path) -> Path:
    """The metadata of a megatron_qrl checkpoint (enough to reach the output check)."""
    from megatron_qrl.models.checkpoint import FORMAT, METADATA_NAME

    (root / "hf").mkdir(parents=True)
    (root / "hf" / "config.json").write_bytes((hf / "config.json").read_bytes())
    (root / METADATA_NAME).write_text(json.dumps({"format": FORMAT, "dtype": "float32"}))
    return root


def test_converters_refuse_an_out_overlapping_the_input(workspace, tmp_path, capsys):
    hf = workspace["hf"]
    before = snapshot(workspace["parent"])
    code, err = run(to_megatron, ["--hf-dir", str(hf), "--out", str(hf / "mg")], capsys)
    assert code == 2 and re.search(r"--out .*hf/mg lies inside the input", err), err
    code, err = run(to_megatron, ["--hf-dir", str(hf), "--out", str(workspace["parent"]),
                                  "--overwrite"], capsys)
    assert code == 2 and "contains the input" in err, err
    assert snapshot(workspace["parent"]) == before
    mg = _fake_megatron_dir(tmp_path / "ckpts" / "mg", hf)
    before = snapshot(tmp_path / "ckpts")
    for out in (mg, tmp_path / "ckpts"):
        code, err = run(to_hf, ["--megatron-dir", str(mg), "--out", str(out), "--overwrite"], capsys)
        assert code == 2 and re.search(r"(is|contains) the input", err), err
    assert snapshot(tmp_path / "ckpts") == before


def _poison(hf: Path, name: str) -> None:
    tensors = load_file(hf / "model.safetensors")
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})


def test_hf_to_megatron_refuses_a_nan_weight(workspace, tmp_path, capsys):
    name = "model.layers.1.mlp.up_proj.weight"
    _poison(workspace["hf"], name)
    code, err = run(to_megatron, ["--hf-dir", str(workspace["hf"]), "--out", str(tmp_path / "mg")],
                    capsys)
    assert code == 2 and f"tensor {name} has 1 non-finite values" in err, err
    assert not (tmp_path / "mg").exists() and not list(tmp_path.glob(".mg.tmp-*"))


def test_megatron_to_hf_refuses_a_nan_weight(workspace, tmp_path, capsys, monkeypatch):
    from megatron_qrl.models import convert

    name = "model.layers.0.self_attn.o_proj.weight"
    _poison(workspace["hf"], name)
    with monkeypatch.context() as patch:  # let the NaN into a Megatron checkpoint
        patch.setattr(convert, "require_finite", lambda *a, **k: None, raising=False)
        assert run(to_megatron, ["--hf-dir", str(workspace["hf"]), "--out",
                                 str(tmp_path / "mg")], capsys)[0] == 0
    code, err = run(to_hf, ["--megatron-dir", str(tmp_path / "mg"), "--out",
                            str(tmp_path / "back")], capsys)
    assert code == 2 and f"tensor {name} has 1 non-finite values" in err, err
    assert not (tmp_path / "back").exists()


@pytest.fixture(scope="module")
def exports(quant_hf, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    return {fmt: export_quantized(quant_hf, fmt, root / fmt, progress=False) for fmt in QUANTIZED}


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_mismatch_report_refuses_a_quantized_export(exports, tmp_path, capsys, fmt):
    out = tmp_path / "r.png"
    code, err = run(mismatch_report, ["--hf-dir", str(exports[fmt]), "--format", "int8",
                                      "--out", str(out), "--batch", "1", "--seq-len", "4"], capsys)
    assert code == 2 and "already has a quantization_config" in err, err
    assert "quantized export" in err and "pass the BF16 checkpoint" in err
    assert not out.exists()


def test_quantized_tensors_are_refused_without_a_quantization_config(exports, tmp_path, capsys):
    """A user who deleted quantization_config still cannot feed codes in as weights."""
    import shutil

    stripped = tmp_path / "stripped"
    shutil.copytree(exports["int8"], stripped)
    cfg = json.loads((stripped / "config.json").read_text())
    cfg.pop("quantization_config")
    (stripped / "config.json").write_text(json.dumps(cfg))
    code, err = run(mismatch_report, ["--hf-dir", str(stripped), "--format", "int8", "--out",
                                      str(tmp_path / "r.png"), "--batch", "1"], capsys)
    assert code == 2 and re.search(r"tensor \S+ is stored as I8.*quantized export", err), err
    code, err = run(to_megatron, ["--hf-dir", str(stripped), "--out", str(tmp_path / "mg")], capsys)
    assert code == 2 and "quantized export" in err and "BF16" in err, err


def test_converter_overwrite_replaces_only_its_own_output(workspace, tmp_path, capsys):
    hf = workspace["hf"]
    out = tmp_path / "mg"
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier conversion\n")
    (out / MARKER_NAME).write_text(json.dumps({"tool": "export_quantized"}))
    code, err = run(to_megatron, ["--hf-dir", str(hf), "--out", str(out), "--overwrite"], capsys)
    assert code == 2 and "written by 'export_quantized'" in err, err
    (out / MARKER_NAME).write_text(json.dumps({"tool": "convert_hf_to_megatron"}))
    assert run(to_megatron, ["--hf-dir", str(hf), "--out", str(out), "--overwrite"], capsys)[0] == 0
    assert not (out / "stale.txt").exists() and (out / "megatron_qrl.json").is_file()
    assert json.loads((out / MARKER_NAME).read_text())["tool"] == "convert_hf_to_megatron"
