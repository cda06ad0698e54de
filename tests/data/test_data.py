"""Char tokenizer, synthetic addition task, JSONL loader, tiny model configs."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_qrl.data import (
    CharTokenizer,
    addition_problems,
    count_addition_problems,
    load_prompt_jsonl,
    padded_vocab_size,
    tiny_dense_config,
    tiny_moe_config,
    write_jsonl,
)
from megatron_qrl.quant import get_spec, list_specs


def test_char_tokenizer_ids_roundtrip_and_files(tmp_path):
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id, tok.vocab_size) == (0, 1, 2, 3, 100)
    assert tok.encode(" !") == [4, 5] and tok.encode("\n") == [99]
    ids = tok.encode("12+345=357", add_bos=True, add_eos=True)
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 12
    assert tok.decode(ids) == "12+345=357"
    assert tok.decode(ids, skip_special=False) == "<bos>12+345=357<eos>"
    assert tok.encode("é") == [3]
    with pytest.raises(ValueError, match="'é' at position 1"):
        tok.encode("aé", strict=True)
    with pytest.raises(ValueError, match="id 100 outside"):
        tok.decode([100])
    tok.save(tmp_path)
    again = CharTokenizer.load(tmp_path)
    assert again.encode("Hello, 42!") == tok.encode("Hello, 42!")
    with pytest.raises(FileNotFoundError, match="not found"):
        CharTokenizer.load(tmp_path / "missing")


def test_char_tokenizer_hf_directory(tmp_path):
    from transformers import AutoTokenizer

    tok = CharTokenizer()
    tok.save(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "12 + 3=\n15"
    assert hf(text).input_ids == tok.encode(text)
    assert hf.decode(tok.encode(text)) == text
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)


def test_addition_problems_deterministic_distinct_and_correct():
    a = addition_problems(200, seed=3, digits_min=1, digits_max=3)
    assert a == addition_problems(200, seed=3, digits_min=1, digits_max=3)
    assert a != addition_problems(200, seed=4, digits_min=1, digits_max=3)
    assert len({p["prompt"] for p in a}) == 200
    for p in a:
        lhs, rhs = p["prompt"].rstrip("=").split("+")
        assert p["prompt"].endswith("=") and int(lhs) + int(rhs) == int(p["answer"])
        assert 1 <= len(lhs) <= 3 and 1 <= len(rhs) <= 3
        assert len(lhs) == 1 or lhs[0] != "0"
    exact = addition_problems(50, seed=0, digits_min=4, digits_max=4)
    assert all(len(x) == 4 for p in exact for x in p["prompt"].rstrip("=").split("+"))


def test_addition_problem_counts_and_errors():
    assert count_addition_problems(1, 1) == 100
    assert count_addition_problems(2, 2) == 90 * 90
    assert count_addition_problems(1, 2) == 100 * 100
    assert len(addition_problems(100, 0, 1, 1)) == 100  # every pair, still terminates
    with pytest.raises(ValueError, match="--qrl-task-num-prompts"):
        addition_problems(101, 0, 1, 1)
    with pytest.raises(ValueError, match="digits_min <= digits_max"):
        addition_problems(1, 0, 3, 2)


def test_jsonl_roundtrip_and_errors(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", addition_problems(5, 1))
    recs = load_prompt_jsonl(path)
    assert [r.prompt for r in recs] == [p["prompt"] for p in addition_problems(5, 1)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": 2}\n\n{"prompt": "2+2=", answer: 4}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl, line 3: invalid JSON"):
        load_prompt_jsonl(bad)
    bad.write_text('{"prompt": "1+1="}\n')
    with pytest.raises(ValueError, match="line 1: missing key\\(s\\) answer"):
        load_prompt_jsonl(bad)
    bad.write_text('[1, 2]\n')
    with pytest.raises(ValueError, match="line 1: expected a JSON object"):
        load_prompt_jsonl(bad)
    bad.write_text('{"prompt": "", "answer": "1"}\n')
    with pytest.raises(ValueError, match="non-empty string"):
        load_prompt_jsonl(bad)
    bad.write_text("\n")
    with pytest.raises(ValueError, match="no records"):
        load_prompt_jsonl(bad)
    with pytest.raises(FileNotFoundError, match="--qrl-task-prompts .*missing.jsonl: file not found"):
        load_prompt_jsonl(tmp_path / "missing.jsonl")
    good = tmp_path / "num.jsonl"
    good.write_text(json.dumps({"prompt": "p", "answer": 2.5}) + "\n")
    assert load_prompt_jsonl(good)[0].answer == "2.5"


def test_tiny_configs_build_and_fit_every_format():
    import transformers

    assert padded_vocab_size(100) == 128 and padded_vocab_size(128) == 128
    assert padded_vocab_size(129) == 192
    moe = tiny_moe_config(CharTokenizer().vocab_size)
    assert moe["vocab_size"] == 128 and moe["num_experts"] == 8 and moe["num_experts_per_tok"] == 2
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**moe))
    ids = torch.tensor([CharTokenizer().encode("12+34=", add_bos=True)])
    assert model(ids).logits.shape == (1, 7, 128)
    dense = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**tiny_dense_config(100)))
    sd = dense.state_dict()
    linears = [n for n in sd if n.endswith("_proj.weight")]
    assert all(sd[n].shape[0] % 128 == 0 and sd[n].shape[1] % 128 == 0 for n in linears)
    for name in list_specs():
        packed = dict(get_spec(name).pack_state_dict(sd.items()))
        assert packed  # every format packs every linear of the tiny model
