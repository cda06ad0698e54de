"""--qrl-task-demo-noise: demonstrations with a trailing 0 in the warm-up, reward on the true sum."""

import pytest

from megatron_qrl.data.synthetic import addition_problems, noisy_demos
from megatron_qrl.rewards import score_math
from megatron_qrl.rl.cli import parse_configs


def test_noisy_demos_append_a_zero_to_a_fraction():
    answers = [str(n) for n in range(10000)]
    assert noisy_demos(answers, 0.0, 1) == answers
    assert noisy_demos(answers[:3], 1.0, 1) == ["00", "10", "20"]
    out = noisy_demos(answers, 0.5, 7)
    assert out == noisy_demos(answers, 0.5, 7) != noisy_demos(answers, 0.5, 8)
    assert all(o in (a, a + "0") for o, a in zip(out, answers))
    assert abs(sum(o != a for o, a in zip(out, answers)) / len(answers) - 0.5) < 0.03
    with pytest.raises(ValueError, match="--qrl-task-demo-noise"):
        noisy_demos(answers, 1.5, 0)


def test_noisy_answer_earns_only_the_format_bonus():
    for p in addition_problems(50, seed=3, digits_min=1, digits_max=2):
        a = p["answer"]
        assert score_math(a, a, 0.1).reward == pytest.approx(1.1)
        if a != "0":  # 0 * 10 == 0
            assert score_math(a + "0", a, 0.1).reward == pytest.approx(0.1)


def test_flag_and_default_job():
    configs, _, _ = parse_configs([])
    assert configs["task"].demo_noise == 0.5  # the tiny-cpu default job
    assert parse_configs(["--qrl-task-demo-noise", "0"])[0]["task"].demo_noise == 0.0
    with pytest.raises(Exception, match="--qrl-task-demo-noise"):
        parse_configs(["--qrl-task-demo-noise", "2"])


class _Trainer:
    def __init__(self):
        self.batches = []

    def train_step(self, mbs, loss_fn, **kwargs):
        self.batches += mbs
        return {}, 0.0


@pytest.mark.parametrize("noise", [0.0, 0.5])
def test_sft_step_trains_on_the_noisy_demos(noise):
    from megatron_qrl.data import CharTokenizer
    from megatron_qrl.data.dataset import PromptRecord
    from megatron_qrl.rl.steps import StepContext, sft_step

    configs, _, _ = parse_configs(["--qrl-task-demo-noise", str(noise)])
    recs = [PromptRecord(p["prompt"], p["answer"])
            for p in addition_problems(64, seed=1, digits_min=2, digits_max=2)]
    tok, trainer = CharTokenizer(), _Trainer()
    ctx = StepContext(configs, tok, recs, trainer, None, None, None, None)
    sft_step(ctx, 0)
    prompts, targets = [], []
    for mb in trainer.batches:
        for toks, labels, mask in zip(mb["tokens"], mb["labels"], mb["loss_mask"]):
            prompts.append(tok.decode(toks[~mask]).split("=")[0] + "=")
            targets.append(tok.decode(labels[mask]))
    truth = {r.prompt: r.answer for r in recs}
    wrong = [t != truth[p] for p, t in zip(prompts, targets)]
    assert all(t in (truth[p], truth[p] + "0") for p, t in zip(prompts, targets))
    n = len(wrong)  # 16 prompts x 8 samples
    assert n == 128
    if noise == 0.0:
        assert not any(wrong)
    else:
        assert 0.35 < sum(wrong) / n < 0.65
