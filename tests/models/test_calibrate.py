"""ModelOpt-calibrated PTQ (models/calibrate.py, tools/export_quantized.py --calibrate): AWQ and
SmoothQuant move the quantization error the way each method intends, keep the model's function
and the format's checkpoint layout; pairs that do not combine are refused in one line."""

import json

import pytest
import torch

from megatron_qrl.data.tiny_model import tiny_moe_config
from megatron_qrl.models.calibrate import CalibrationError, calibrate_tensors, check_method
from megatron_qrl.models.export import export_quantized
from megatron_qrl.quant import get_spec
from megatron_qrl.quant.hf_reference import (
    build_hf_model,
    hf_tensor_names,
    hf_tensors,
    load_packed_weights,
    quantized_copy,
)
from megatron_qrl.rollout.base import SamplingParams
from megatron_qrl.rollout.reference import ReferenceEngine
from tests.helpers.tiny_hf import make_tiny_hf, read_safetensors_dir
from tools.export_quantized import main as export_main

VOCAB = 64
CFG = tiny_moe_config(VOCAB)


@pytest.fixture(scope="module")
def outlier_model():
    """The tiny MoE with a few norm channels x20: the activation outliers of real LLMs (the
    inputs both methods are designed for), plus its calibration sequences."""
    torch.manual_seed(0)
    model = build_hf_model(CFG, torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[torch.randperm(norm.weight.numel())[:4]] *= 20.0
    g = torch.Generator().manual_seed(1)
    calib = [torch.randint(0, VOCAB, (12,), generator=g).tolist() for _ in range(16)]
    return model, dict(hf_tensors(model)), calib


def _model_from(state):
    m = build_hf_model(CFG, torch.float32)
    load_packed_weights(m, get_spec("bf16"), state, hf_tensor_names(m))
    return m


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def calibrated(outlier_model):
    _, state, calib = outlier_model
    return {m: calibrate_tensors(CFG, state.items(), m, f, calib)
            for m, f in (("awq", "w4a16"), ("smoothquant", "int8"))}


@pytest.mark.parametrize("method", ["awq", "smoothquant"])
def test_calibration_keeps_the_full_precision_function(outlier_model, calibrated, method):
    """Folding the scales into norms / producing rows is exact maths: the unquantized model
    computes the same logits (fails if a scale is applied to the weight but not folded)."""
    model, state, calib = outlier_model
    new = calibrated[method]
    assert sorted(new) == sorted(state) and all(new[n].dtype == state[n].dtype for n in state)
    moved = [n for n in state if not torch.equal(new[n], state[n])]
    assert any(n.endswith("input_layernorm.weight") for n in moved)
    assert any(n.endswith("v_proj.weight") for n in moved)  # o_proj's scale, folded
    x = torch.tensor(calib)
    with torch.no_grad():
        assert _rel(_model_from(new)(x).logits, model(x).logits) < 1e-5


def test_awq_lowers_the_w4a16_output_error(outlier_model, calibrated):
    """AWQ (eq. 4-5): on the calibration set, the W4A16 model's logits are closer to the
    full-precision ones than round-to-nearest's at the same bits."""
    model, state, calib = outlier_model
    x, spec = torch.tensor(calib), get_spec("w4a16")
    with torch.no_grad():
        ref = model(x).logits
        rtn = _rel(quantized_copy(model, spec)(x).logits, ref)
        awq = _rel(quantized_copy(_model_from(calibrated["awq"]), spec)(x).logits, ref)
    assert awq < 0.95 * rtn, (awq, rtn)


def _qkv_act_error(model, x, spec):
    """Relative output error of layer 0's q/k/v from int8 per-token activation quantization
    alone (the weights unquantized): ``||(Q(x) - x) W^T|| / ||x W^T||``."""
    seen = []
    att = model.model.layers[0].self_attn
    h = att.q_proj.register_forward_pre_hook(lambda _m, a: seen.append(a[0].detach()))
    with torch.no_grad():
        model(x)
    h.remove()
    a = seen[0].reshape(-1, seen[0].shape[-1])
    w = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]).detach()
    return _rel(spec.fake_quant_activation(a) @ w.T, a @ w.T)


def test_smoothquant_lowers_the_activation_quantization_error(outlier_model, calibrated):
    """SmoothQuant (eq. 4): the smoothed q/k/v inputs lose less to SGLang's per-token INT8
    activation quantization, and the whole W8A8 model's logits are closer to full precision."""
    model, _, calib = outlier_model
    x, spec = torch.tensor(calib), get_spec("int8")
    sq = _model_from(calibrated["smoothquant"])
    assert _qkv_act_error(sq, x, spec) < 0.7 * _qkv_act_error(model, x, spec)
    with torch.no_grad():
        ref = model(x).logits
        rtn = _rel(quantized_copy(model, spec)(x).logits, ref)
        smooth = _rel(quantized_copy(sq, spec)(x).logits, ref)
    assert smooth < 0.95 * rtn, (smooth, rtn)


@pytest.mark.parametrize("method,fmt", [("awq", "int8"), ("awq", "fp8"), ("smoothquant", "w4a16"),
                                        ("smoothquant", "nvfp4"), ("awq", "bf16")])
def test_pairs_that_do_not_combine_are_refused_in_one_line(tmp_path, capsys, method, fmt):
    with pytest.raises(CalibrationError, match=f"--calibrate {method} does not combine with "
                                               f"--format {fmt}"):
        check_method(method, fmt)
    rc = export_main(["--hf-dir", str(tmp_path / "missing"), "--format", fmt,
                      "--calibrate", method, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--calibrate" in err[0] and f"--format {fmt}" in err[0]
    assert not (tmp_path / "o").exists()


_read = read_safetensors_dir


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = make_tiny_hf(tmp_path_factory.mktemp("hf") / "moe", "moe", dtype=torch.bfloat16,
                     hidden_size=128, head_dim=128, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=256, moe_intermediate_size=128)
    from megatron_qrl.data import CharTokenizer

    CharTokenizer().save(d)
    return d


@pytest.mark.parametrize("fmt", ["int8", "w4a16", "fp8_block"])
def test_calibrate_none_is_the_round_to_nearest_export(hf_dir, tmp_path, fmt):
    """``--calibrate none`` writes the bytes ``spec.pack_state_dict`` gives the input."""
    assert export_main(["--hf-dir", str(hf_dir), "--format", fmt, "--calibrate", "none",
                        "--out", str(tmp_path / fmt)]) == 0
    got, src = _read(tmp_path / fmt), _read(hf_dir)
    expected = dict(get_spec(fmt).pack_state_dict(sorted(src.items())))
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[n].view(torch.uint8), expected[n].contiguous().view(torch.uint8))
               for n in expected)


def test_awq_export_has_the_layout_and_decodes_in_the_reference_engine(hf_dir, tmp_path):
    """The AWQ checkpoint: the names, dtypes, shapes and config of the RTN one, other codes,
    and the reference engine loads it as weight sync would and decodes."""
    assert export_main(["--hf-dir", str(hf_dir), "--format", "w4a16", "--calibrate", "awq",
                        "--calib-samples", "8", "--out", str(tmp_path / "awq")]) == 0
    rtn = export_quantized(hf_dir, "w4a16", tmp_path / "rtn", progress=False)
    a, r = _read(tmp_path / "awq"), _read(rtn)
    assert {n: (t.dtype, t.shape) for n, t in a.items()} == \
           {n: (t.dtype, t.shape) for n, t in r.items()}
    assert json.loads((tmp_path / "awq" / "config.json").read_text()) == \
           json.loads((rtn / "config.json").read_text())
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight_packed"],
                           r["model.layers.0.self_attn.q_proj.weight_packed"])
    cfg = json.loads((hf_dir / "config.json").read_text())
    engine = ReferenceEngine(cfg, "w4a16")
    engine.update_weights(sorted(a.items()), version=1)
    out = engine.generate([[1, 5, 6, 7]] * 2, SamplingParams(max_new_tokens=4, temperature=0.0))
    assert all(len(r) == 4 for r in out.responses())
