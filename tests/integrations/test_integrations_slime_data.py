"""What a slime run reads from a checkpoint of tools/make_random_checkpoint.py, through slime
0.3.1's own code: its tokenizer / processor loaders, its prompt ``Dataset`` (``--input-key
prompt --label-key answer``), and our reward through its ``--custom-rm-path`` dispatch
(``async_rm`` per sample, ``batched_async_rm`` with ``--group-rm``). slime is found as in
test_integrations_slime.py; without it these tests skip with the reason."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import pytest

from tests.integrations.test_integrations_slime import SKIP

pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

ROOT = Path(__file__).resolve().parents[2]
TINY_MOE = ROOT / "megatron_qrl" / "data" / "configs" / "tiny_qwen3_moe.json"
REWARD = "megatron_qrl.integrations.slime.reward.qrl_math_reward"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from make_random_checkpoint import make_random_checkpoint
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return make_random_checkpoint(str(TINY_MOE), tmp_path_factory.mktemp("c") / "ckpt", layers=1,
                                  seed=5, prompts=40)


def test_slime_loads_tokenizer_and_prompts(ckpt):
    """slime's load_tokenizer gives the char tokenizer's ids (round trip, specials), its
    load_processor finds none (text model), its Dataset reads the prompts file with labels."""
    from slime.utils.data import Dataset
    from slime.utils.processing_utils import load_processor, load_tokenizer

    from megatron_qrl.data import CharTokenizer
    from megatron_qrl.data.synthetic import addition_problems

    tok, ours = load_tokenizer(str(ckpt), trust_remote_code=True), CharTokenizer()
    assert load_processor(str(ckpt), trust_remote_code=True) is None
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (ours.pad_id, ours.bos_id,
                                                                      ours.eos_id)
    want = addition_problems(40, 5)
    lines = [json.loads(x) for x in (ckpt / "prompts.jsonl").read_text().splitlines()]
    assert lines == want
    data = Dataset(str(ckpt / "prompts.jsonl"), tok, None, max_length=16, prompt_key="prompt",
                   label_key="answer")
    assert [(s.prompt, s.label) for s in data.origin_samples] == [
        (r["prompt"], r["answer"]) for r in want]
    for rec in want[:10]:
        text = rec["prompt"] + rec["answer"] + "\n"
        ids = tok.encode(text, add_special_tokens=False)  # as slime's rollout encodes prompts
        assert ids == ours.encode(text, strict=True)
        assert tok.decode(ids) == text == ours.decode(ids)
    ids = ours.encode(want[0]["prompt"]) + [ours.eos_id]
    assert tok.decode(ids, skip_special_tokens=True) == want[0]["prompt"]


def slime_rm_args(**kw) -> argparse.Namespace:
    base = dict(custom_rm_path=REWARD, rm_type=None, group_rm=False)
    base.update(kw)
    return argparse.Namespace(**base)


def test_reward_through_slime_rm_dispatch():
    """slime's async_rm (one sample) and batched_async_rm (--group-rm) call our reward:
    {0, bonus, 1 + bonus} as score_math gives; --qrl-task-format-bonus is honoured and checked;
    a sample without a label names --label-key."""
    from slime.rollout.rm_hub import async_rm, batched_async_rm
    from slime.utils.types import Sample

    from megatron_qrl.config import QrlArgumentError

    def sample(response, label="46"):
        return Sample(prompt="12+34=", response=response, label=label)

    cases = [("46", 1.1), ("the sum is 46", 1.1), ("47", 0.1), ("no number", 0.0), ("", 0.0),
             ("46, no: 47", 0.1)]
    args = slime_rm_args()
    got = [asyncio.run(async_rm(args, sample(r))) for r, _ in cases]
    assert got == pytest.approx([w for _, w in cases])
    group = asyncio.run(batched_async_rm(slime_rm_args(group_rm=True),
                                         [sample(r) for r, _ in cases]))
    assert group == pytest.approx(got)
    no_bonus = slime_rm_args(qrl_task_format_bonus=0.0)
    assert asyncio.run(async_rm(no_bonus, sample("47"))) == 0.0
    assert asyncio.run(async_rm(no_bonus, sample("46"))) == 1.0
    with pytest.raises(QrlArgumentError, match="--qrl-task-format-bonus"):
        asyncio.run(async_rm(slime_rm_args(qrl_task_format_bonus=2.0), sample("46")))
    with pytest.raises(QrlArgumentError, match="--label-key"):
        asyncio.run(async_rm(args, sample("46", label=None)))


def test_prompts_flag_is_checked(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from make_random_checkpoint import make_random_checkpoint
    finally:
        sys.path.remove(str(ROOT / "tools"))
    with pytest.raises(ValueError, match="--prompts"):
        make_random_checkpoint(str(TINY_MOE), tmp_path / "x", layers=1, prompts=10**7)
    assert not (tmp_path / "x").exists()
