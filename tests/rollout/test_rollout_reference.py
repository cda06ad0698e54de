"""The reference rollout engine: packed-weight sync, verification, generation, routing."""

import pytest
import torch

from megatron_qrl.quant import get_spec
from megatron_qrl.quant.hf_reference import hf_tensors, quantized_copy
from megatron_qrl.rollout import SamplingParams, WeightManifest, WeightSyncError
from megatron_qrl.rollout.reference import ReferenceEngine, build_hf_model
from megatron_qrl.rollout.sampling import sample_next

CFG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 64,
       "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128,
       "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
       "head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
       "max_position_embeddings": 128, "tie_word_embeddings": False}
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [3]]


def random_source(seed=0):
    """The trainer-side HF model whose weights the tests sync (std 0.2: no near-ties)."""
    torch.manual_seed(seed)
    model = build_hf_model(CFG, torch.float32, "cpu")
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.normal_(0, 0.2)
    return model


@pytest.fixture(scope="module")
def source():
    return random_source()


def _engine(source, fmt="int8", seed=0):
    spec = get_spec(fmt)
    engine = ReferenceEngine(CFG, fmt, seed=seed)
    manifest = WeightManifest()
    engine.update_weights(manifest.record(spec.pack_state_dict(hf_tensors(source))), version=3)
    engine.verify(manifest)
    return engine, manifest


@pytest.mark.parametrize("fmt", ["bf16", "int8", "fp8_block", "nvfp4"])
def test_logprobs_match_a_teacher_forced_rollout_side_model(source, fmt):
    engine, _ = _engine(source, fmt)
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0))
    assert engine.weight_version() == out.weight_version == 3
    ref_model = quantized_copy(source, get_spec(fmt))
    for i, prompt in enumerate(PROMPTS):
        resp = out.responses()[i]
        ids = torch.tensor([prompt + resp])
        with torch.no_grad():
            lp = torch.log_softmax(ref_model(ids).logits.float(), -1)[0]
        expect = torch.stack([lp[len(prompt) - 1 + t, tok] for t, tok in enumerate(resp)])
        torch.testing.assert_close(out.logprobs[i, : len(resp)], expect, atol=2e-4, rtol=0)
        assert lp[len(prompt) - 1:].argmax(-1)[: len(resp)].tolist() == resp  # greedy


def test_routed_experts_are_the_routers_choices_for_prompt_and_response(source):
    engine, _ = _engine(source, "bf16")
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, temperature=0))
    ref = quantized_copy(source, get_spec("bf16"))
    chosen = []
    hooks = [m.register_forward_hook(lambda _m, _i, o: chosen.append(o[2]))
             for n, m in ref.named_modules() if n.endswith("mlp.gate")]
    for i, prompt in enumerate(PROMPTS):
        chosen.clear()
        resp = out.responses()[i]
        with torch.no_grad():
            ref(torch.tensor([prompt + resp[:-1]]))
        want = torch.stack(chosen, dim=1)  # [tokens, layers, k]
        got = out.routed_experts[i, : want.shape[0]]
        assert torch.equal(got.sort(-1).values, want.sort(-1).values)
        assert (out.routed_experts[i, want.shape[0]:] == -1).all()
    for h in hooks:
        h.remove()


def test_verify_names_a_tensor_the_engine_holds_differently(source):
    engine, manifest = _engine(source)
    name = "model.layers.1.mlp.experts.4.up_proj.weight_scale"
    engine._packed[name] = engine._packed[name] * 2
    with pytest.raises(WeightSyncError, match=name.replace(".", r"\.")):
        engine.verify(manifest)


def test_incomplete_or_foreign_stream_is_rejected(source):
    engine = ReferenceEngine(CFG, "int8")
    stream = [(n, t) for n, t in get_spec("int8").pack_state_dict(hf_tensors(source))
              if "layers.0.self_attn.k_proj" not in n]
    with pytest.raises(WeightSyncError, match=r"missing \['model\.layers\.0\.self_attn\.k_proj"):
        engine.update_weights(stream, 1)
    bf16_stream = list(hf_tensors(source))
    with pytest.raises(WeightSyncError, match="weight_scale"):
        engine.update_weights(bf16_stream, 1)
    with pytest.raises(WeightSyncError, match="before the first update_weights"):
        engine.generate(PROMPTS, SamplingParams())


def test_stop_tokens_lengths_and_seeded_sampling(source):
    engine, _ = _engine(source)
    greedy = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=0))
    stop = greedy.output_ids[0, 1].item()
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=0,
                                                  stop_token_ids=(stop,)))
    assert out.finish_reasons[0] == "stop" and out.responses()[0][-1] == stop
    assert greedy.finish_reasons == ["length"] * 3 and greedy.mask.all()
    a = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=1.0, seed=7))
    b = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=1.0, seed=7))
    assert torch.equal(a.output_ids, b.output_ids) and torch.equal(a.logprobs, b.logprobs)
    k1 = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=0.7, top_k=1))
    assert torch.equal(k1.output_ids, greedy.output_ids)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    gen = torch.Generator().manual_seed(0)
    seen = {int(sample_next(logits, SamplingParams(top_p=0.6), gen)[0]) for _ in range(200)}
    assert seen == {0, 1}
    tok, lp = sample_next(logits, SamplingParams(temperature=0), gen)
    assert tok.item() == 0 and torch.isclose(lp, torch.log(torch.tensor([0.5]))).all()


def test_sglang_engine_refuses_sync_paths_measured_broken_before_importing_sglang():
    from megatron_qrl.rollout_sglang import SGLangEngine, SGLangOptions

    with pytest.raises(NotImplementedError, match=r"cannot update 'int8' weights in place"):
        SGLangEngine("/nonexistent", "int8", SGLangOptions(sync="tensor"))
    with pytest.raises(TypeError, match="sync= is an SGLangOptions field"):
        SGLangEngine("/nonexistent", "int8", sync="inplace")


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8_block", "w4a16", "nvfp4"])
def test_plain_tensor_sync_is_refused_for_every_format_that_quantizes_weights(fmt):
    from megatron_qrl.rollout_sglang.options import check_sync_supported

    with pytest.raises(NotImplementedError, match=r"rollout-sglang-sync inplace"):
        check_sync_supported(fmt, "tensor")
    check_sync_supported(fmt, "inplace")


def test_sync_paths_measured_working_or_not_yet_run_are_allowed():
    from megatron_qrl.rollout_sglang.options import check_sync_supported

    for fmt, sync in [("bf16", "tensor"), ("bf16", "disk"), ("fp8_block", "disk"),
                      ("fp8", "distributed"), ("nvfp4", "inplace"), ("w4a16", "disk")]:
        check_sync_supported(fmt, sync)
    for fmt in ("int8", "fp8"):  # SGLang's update_weights_from_disk: load_weights fails
        with pytest.raises(NotImplementedError,
                           match=rf"'{fmt}' .* sync='disk' \(measured on H200"):
            check_sync_supported(fmt, "disk")
