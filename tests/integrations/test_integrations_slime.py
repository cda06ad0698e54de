"""megatron_qrl inside slime: the custom loss / TIS through slime 0.3.1's own loss entry points,
the options, the error-token post-process and the launcher — against slime's real code.

slime is not a dependency: its unmodified 0.3.1 package is found at
``<an ancestor of this checkout>/shared/third_party/slime-0.3.1`` (``../shared/...`` from the
main checkout and from CI's clone, ``../../shared/...`` from a worktree) or at ``$SLIME_SRC``;
without it every test here skips with that reason.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

SLIME_DIRNAME = ("shared", "third_party", "slime-0.3.1")


def find_slime_src() -> Path | None:
    """The slime 0.3.1 source folder ($SLIME_SRC, else the first ancestor holding it)."""
    repo = Path(__file__).resolve().parents[2]
    candidates = ([Path(os.environ["SLIME_SRC"])] if os.environ.get("SLIME_SRC") else
                  [parent.joinpath(*SLIME_DIRNAME) for parent in (repo, *repo.parents)])
    return next((c for c in candidates if (c / "slime" / "__init__.py").is_file()), None)


def slime_skip_reason() -> str | None:
    """None when slime's loss and sync modules import here, else why not."""
    src = find_slime_src()
    if importlib.util.find_spec("slime") is None:
        if src is None:
            where = os.environ.get("SLIME_SRC") or (f"{'/'.join(SLIME_DIRNAME)} above "
                                                     f"{Path(__file__).resolve().parents[2]}")
            return f"slime 0.3.1 source not found (looked at $SLIME_SRC or {where})"
        sys.path.insert(0, str(src))
    try:
        import slime.backends.megatron_utils.loss  # noqa: F401  (needs httpx)
        import slime.backends.megatron_utils.megatron_to_hf  # noqa: F401
    except ImportError as exc:
        return f"slime 0.3.1's modules do not import here: {exc}"
    return None


SKIP = slime_skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

LOSS = "megatron_qrl.integrations.slime.loss.qrl_policy_loss"
TIS = "megatron_qrl.integrations.slime.loss.qrl_tis_function"
KINDS = ("ppo_clip", "naive_quant", "decoupled", "tis", "acr", "tbpo")
PROMPTS, RESPONSES, VOCAB = (3, 5, 2, 4), (4, 7, 3, 6), 11


@pytest.fixture(scope="module")
def megatron():
    from megatron_qrl.models.runtime import single_process_megatron

    with single_process_megatron():
        yield


def slime_args(**kw) -> argparse.Namespace:
    """The slime flags the loss path reads (slime's defaults), qrl keys as from a YAML."""
    base = dict(loss_type="custom_loss", custom_loss_function_path=LOSS, calculate_per_token_loss=False,
                recompute_loss_function=False, allgather_cp=False, rollout_temperature=1.0,
                log_probs_chunk_size=-1, entropy_coef=0.0, rollout_top_p=1.0,
                qrl_error_tokens_action="none", qrl_loss_dual_clip_c=3.0)
    base.update(kw)
    return argparse.Namespace(**base)


def packed_batch(seed: int = 0):
    """Several packed samples (prompt + response) in slime's micro-batch layout at CP = 1,
    their logits [1, T, V], and the same data padded [n, R] for the reference loss."""
    g = torch.Generator().manual_seed(seed)
    totals = [p + r for p, r in zip(PROMPTS, RESPONSES)]
    logits = torch.randn(1, sum(totals), VOCAB, generator=g).requires_grad_()
    tokens = [torch.randint(0, VOCAB, (t,), generator=g) for t in totals]
    n, rmax = len(PROMPTS), max(RESPONSES)
    pad = {k: torch.zeros(n, rmax) for k in ("lp", "prox", "behav", "adv", "ref", "mask")}
    batch = {k: [] for k in ("log_probs", "rollout_log_probs", "advantages", "ref_log_probs",
                             "loss_masks")}
    start = 0
    for i, (p, r, tok) in enumerate(zip(PROMPTS, RESPONSES, tokens)):
        rows = torch.log_softmax(logits[0, start + p - 1:start + p + r - 1], -1)
        lp = rows.gather(-1, tok[p:, None])[:, 0]
        prox = lp.detach() + 0.3 * torch.randn(r, generator=g)
        behav = prox + 0.5 * torch.randn(r, generator=g)
        adv = torch.full((r,), float(torch.randn((), generator=g)))
        ref = prox + 0.2 * torch.randn(r, generator=g)
        mask = (torch.rand(r, generator=g) > 0.25).int()
        mask[0] = 1
        for key, value in (("log_probs", prox), ("rollout_log_probs", behav), ("advantages", adv),
                           ("ref_log_probs", ref), ("loss_masks", mask)):
            batch[key].append(value)
        for key, value in (("lp", lp), ("prox", prox), ("behav", behav), ("adv", adv),
                           ("ref", ref), ("mask", mask.float())):
            pad[key] = pad[key].index_put((torch.tensor([i]), torch.arange(r)), value)
        start += p + r
    batch.update(unconcat_tokens=tokens, total_lengths=totals, response_lengths=list(RESPONSES),
                 rollout_mask_sums=torch.stack([m.sum() for m in batch["loss_masks"]]).float())
    return batch, logits, pad


def reference(pad, kind: str, aggregation: str, kl_coef: float):
    from megatron_qrl.losses import PolicyLossConfig, compute_policy_loss

    cfg = PolicyLossConfig(kind=kind, aggregation=aggregation, dual_clip_c=3.0, kl_coef=kl_coef)
    return compute_policy_loss(pad["lp"], pad["prox"], pad["behav"], pad["adv"], pad["mask"], cfg,
                               ref_log_probs=pad["ref"])


def slime_loss(args, batch, logits):
    """slime's ``loss_function`` (one micro-batch = the whole step), normalised as Megatron
    finally trains on it: / normaliser (per-token) or as is (per-sample, already / n)."""
    from slime.backends.megatron_utils.loss import loss_function

    loss, normaliser, log = loss_function(args, batch, 1, len(PROMPTS), logits)
    metrics = dict(zip(log["keys"], log["values"][1:]))
    return loss / normaliser, metrics, log["values"][0]


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
@pytest.mark.parametrize("kind", KINDS)
def test_custom_loss_equals_compute_policy_loss_per_sample_mean(megatron, kind, kl_coef):
    batch, logits, pad = packed_batch(seed=KINDS.index(kind))
    args = slime_args(qrl_loss_kind=kind, qrl_loss_aggregation="seq_mean_token_mean",
                      qrl_loss_kl_coef=kl_coef, ref_load="/ref" if kl_coef else None)
    got, metrics, _ = slime_loss(args, batch, logits)
    (grad_got,) = torch.autograd.grad(got, logits)
    want, want_metrics = reference(pad, kind, "seq_mean_token_mean", kl_coef)
    (grad_want,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_got, grad_want, rtol=1e-4, atol=1e-7)
    assert float(grad_want.abs().sum()) > 0
    if kind == "tbpo":  # sequence metrics: slime reports sums over samples (/ n at logging)
        for name in ("ratio_mean", "tbpo_out_band_w_frac", "tbpo_seq_mask_frac"):
            torch.testing.assert_close(metrics[name] / len(PROMPTS), want_metrics[name])


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "tbpo"])
def test_custom_loss_equals_compute_policy_loss_token_mean(megatron, kind):
    batch, logits, pad = packed_batch(seed=10 + KINDS.index(kind))
    args = slime_args(qrl_loss_kind=kind, qrl_loss_aggregation="token_mean",
                      calculate_per_token_loss=True)
    got, metrics, num_tokens = slime_loss(args, batch, logits)
    (grad_got,) = torch.autograd.grad(got, logits)
    want, want_metrics = reference(pad, kind, "token_mean", 0.0)
    (grad_want,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_got, grad_want, rtol=1e-4, atol=1e-7)
    assert float(num_tokens) == float(pad["mask"].sum())
    for name in ("ratio_mean", "clip_frac_low", "clip_frac_high", "dual_clip_frac",
                 "tis_trunc_frac", "prox_behav_ratio_mean", "kl_behav_prox_k3",
                 "logp_abs_diff_mean"):
        torch.testing.assert_close(metrics[name] / num_tokens, want_metrics[name],
                                   rtol=1e-5, atol=1e-6, msg=name)


def test_kinds_differ_on_the_same_batch(megatron):
    """The kinds really reach the loss (a mapping bug sending every kind to one would pass
    an equality test only if the reference made the same mistake)."""
    batch, logits, _ = packed_batch(seed=3)
    values = {k: float(slime_loss(slime_args(qrl_loss_kind=k, qrl_loss_tis_cap=1.2,
                                             qrl_loss_aggregation="seq_mean_token_mean"),
                                  batch, logits)[0])
              for k in KINDS}
    assert len({round(v, 6) for v in values.values()}) == len(KINDS), values


def tis_args(kind: str, **kw):
    return slime_args(loss_type="policy_loss", custom_loss_function_path=None, qrl_loss_kind=kind,
                      qrl_loss_aggregation="seq_mean_token_mean", use_tis=True,
                      custom_tis_function_path=TIS, get_mismatch_metrics=False,
                      advantage_estimator="grpo", use_opsm=False, use_rollout_logprobs=False,
                      eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=None, use_kl_loss=False,
                      custom_pg_loss_reducer_function_path=None, **kw)


@pytest.mark.parametrize("kind", ["tis", "acr", "decoupled"])
def test_custom_tis_in_slime_ppo_loss_is_our_weight(megatron, kind):
    """slime's own ``policy_loss_function`` with our TIS: pg_loss = slime's PPO per-token loss
    times w = min(pi_prox / pi_behav, C) (tis, acr) or pi_prox / pi_behav (decoupled)."""
    from slime.backends.megatron_utils.cp_utils import get_sum_of_sample_mean
    from slime.backends.megatron_utils.loss import policy_loss_function
    from slime.utils.ppo_utils import compute_policy_loss as slime_ppo

    batch, logits, pad = packed_batch(seed=20)
    args = tis_args(kind, qrl_loss_tis_cap=1.5)
    reducer = get_sum_of_sample_mean(batch["total_lengths"], batch["response_lengths"],
                                     batch["loss_masks"], batch["rollout_mask_sums"])
    _, metrics = policy_loss_function(args, batch, logits, reducer)
    lp = torch.cat([pad["lp"][i, :r] for i, r in enumerate(RESPONSES)]).detach()
    prox, behav = torch.cat(batch["log_probs"]), torch.cat(batch["rollout_log_probs"])
    mask = torch.cat(batch["loss_masks"]).bool()
    per_token, _ = slime_ppo(prox - lp, torch.cat(batch["advantages"]), 0.2, 0.2)
    d = torch.where(mask, prox - behav, 0.0)
    weight = torch.exp(d) if kind == "decoupled" else torch.clamp(torch.exp(d), max=1.5)
    torch.testing.assert_close(metrics["pg_loss"], reducer(per_token * weight))
    torch.testing.assert_close(metrics["tis_weight"], reducer(weight))
    assert float(reducer((weight != torch.exp(d)).float())) > 0 or kind == "decoupled"


def test_custom_tis_refuses_unweighted_kinds():
    from megatron_qrl.config import QrlArgumentError
    from megatron_qrl.integrations.slime.options import slime_options

    with pytest.raises(QrlArgumentError, match="--custom-tis-function-path.*ppo_clip"):
        slime_options(tis_args("ppo_clip"))


def test_options_from_yaml_keys_and_slime_flags():
    from megatron_qrl.config import QrlArgumentError
    from megatron_qrl.integrations.slime import options as o
    from megatron_qrl.integrations.slime.options import POSTPROCESS_PATH, SPEC, slime_options

    opts = slime_options(slime_args(qrl_loss_kind="acr", qrl_loss_aggregation="seq_mean_token_mean",
                                    qrl_loss_tis_cap=3.0))
    assert (opts.loss.kind, opts.loss.tis_cap, opts.rollout.format) == ("acr", 3.0, "bf16")
    cases = [
        (dict(qrl_loss_kind="acr", qrl_lsos_kind="x"), "unknown qrl option.*qrl_lsos_kind"),
        (dict(qrl_loss_aggregation="token_mean"), "add --calculate-per-token-loss"),
        (dict(qrl_loss_aggregation="seq_mean_token_mean", calculate_per_token_loss=True),
         "drop --calculate-per-token-loss"),
        (dict(qrl_loss_aggregation="seq_mean_token_mean", use_rollout_logprobs=True),
         "--use-rollout-logprobs"),
        (dict(qrl_loss_aggregation="seq_mean_token_mean", qrl_loss_kl_coef=0.1), "--ref-load"),
        (dict(qrl_loss_aggregation="seq_mean_token_mean", qrl_error_tokens_action="mask"),
         POSTPROCESS_PATH),
        (dict(qrl_loss_aggregation="seq_mean_token_mean", qrl_rollout_format="int8",
              qrl_train_forward="aligned"), " ".join(SPEC)),
        (dict(qrl_loss_aggregation="seq_mean_token_mean", qrl_rollout_format="fp8_block",
              qrl_train_forward="aligned", qrl_train_aligned_gemm="real", spec=SPEC),
         "--qrl-train-aligned-gemm real: inside slime.*use auto or fake"),
        (dict(qrl_loss_aggregation="seq_mean_token_mean", qrl_rollout_format="w4a16"),
         "--qrl-rollout-format w4a16 need the init hook.*--custom-megatron-init-path"),
        (dict(qrl_loss_aggregation="seq_mean_token_mean", qrl_aqn_enabled=True,
              custom_megatron_init_path=o.INIT_PATH), "--custom-megatron-before-train-step-hook"),
        (dict(qrl_loss_aggregation="seq_mean_token_mean", qrl_routing_replay="all"),
         "--use-rollout-routing-replay"),
        (dict(qrl_loss_kind="tbpo", qrl_loss_aggregation="token_mean",
              calculate_per_token_loss=True), "tbpo is sequence-level"),
        (dict(qrl_loss_aggregation="seq_mean_token_mean", qrl_train_moe_experts="stacked"),
         "--qrl-train-moe-experts stacked inside slime.*linear_fc1.weight<i>"),
    ]
    for kw, match in cases:
        with pytest.raises(QrlArgumentError, match=match):
            slime_options(slime_args(**kw))


POSTPROCESS = "megatron_qrl.integrations.slime.postprocess.qrl_rollout_data_postprocess"


def error_token_data():
    """Two samples: one with a 14-token repetition and one improbable token, one clean; the
    loss masks the post-process must produce."""
    prompt, resp = 3, 30
    tokens = torch.cat([torch.tensor([1, 2, 3]), torch.arange(10) % 7 + 20,
                        torch.full((14,), 5), torch.arange(6) + 40])
    lprox = torch.full((resp,), -1.0)
    lbehav = lprox.clone()
    lprox[2], lbehav[2] = -15.0, -0.5  # improbable for the trainer, likely for the engine
    clean = torch.randperm(100, generator=torch.Generator().manual_seed(0))[:prompt + resp]
    data = {"tokens": [tokens, clean], "total_lengths": [prompt + resp] * 2,
            "response_lengths": [resp] * 2, "loss_masks": [torch.ones(resp, dtype=torch.int)] * 2,
            "log_probs": [lprox, torch.full((resp,), -1.0)],
            "rollout_log_probs": [lbehav, torch.full((resp,), -1.0)]}
    want = torch.ones(resp, dtype=torch.int)
    want[10:24] = 0  # the run of 14 identical tokens
    want[2] = 0
    return data, [want, torch.ones(resp, dtype=torch.int)]


def test_error_token_postprocess_folds_mask(megatron):
    from megatron_qrl.integrations.slime.postprocess import qrl_rollout_data_postprocess

    data, want = error_token_data()
    args = slime_args(qrl_loss_aggregation="seq_mean_token_mean", qrl_error_tokens_action="mask",
                      rollout_data_postprocess_path=POSTPROCESS)
    qrl_rollout_data_postprocess(args, 0, data)
    assert all(m.dtype == torch.int for m in data["loss_masks"])
    assert all(torch.equal(g, w) for g, w in zip(data["loss_masks"], want))
    assert data["qrl_error_token_rate"] == pytest.approx([15 / 30, 0.0])
    assert data["qrl_error_seq_rate"] == [1.0, 0.0]


def test_launcher_fills_hooks_and_refuses_clashes():
    from megatron_qrl.config import QrlArgumentError, add_qrl_args
    from megatron_qrl.integrations.slime import options as o
    from megatron_qrl.integrations.slime.launch import fill_hooks

    parser = add_qrl_args(argparse.ArgumentParser())
    args = parser.parse_args(["--qrl-rollout-format", "int8", "--qrl-train-forward", "aligned"])
    for k, v in vars(slime_args(custom_megatron_init_path=None, spec=None)).items():
        if not k.startswith("qrl_"):
            setattr(args, k, v)
    done = fill_hooks(args)
    assert args.spec == o.SPEC and args.custom_megatron_init_path == o.INIT_PATH
    assert args.rollout_data_postprocess_path == o.POSTPROCESS_PATH and len(done) == 5
    args.custom_megatron_before_train_step_hook_path = "mine.hook"
    with pytest.raises(QrlArgumentError, match="before-train-step-hook-path"):
        fill_hooks(args)


@pytest.mark.slow
def test_launcher_parses_a_real_slime_command_line(tmp_path):
    """slime's own parse_args with add_qrl_args parses a full command line (Megatron-LM's and
    sglang's server args too) for a tiny random Qwen3-MoE checkpoint, with our flags; the
    launcher fills the hooks and validates. In this process where slime's imports (sglang,
    sglang_router, wandb, megatron.training) are installed (the GPU image); on a CPU machine in
    a subprocess over the site tools/slime_cpu_site.sh builds."""
    import json
    import subprocess

    from megatron_qrl.integrations.slime import options as o
    from tests.helpers import slime_cli

    if slime_cli.missing_in_process() is None:
        got = slime_cli.parse_command_line(tmp_path)
    else:
        site = slime_cli.cpu_site()
        if site is None:
            why = (f"slime's parse_args needs {slime_cli.missing_in_process()}: build its "
                   "CPU site with `bash tools/slime_cpu_site.sh` (6 GB; the script says "
                   "what it needs)")
            if os.environ.get("QRL_REQUIRE_SLIME_SITE") == "1":  # CI built it: a skip is a bug
                pytest.fail(why)
            pytest.skip(why)
        path = os.pathsep.join([str(site), str(slime_cli.REPO), str(find_slime_src())])
        env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
        run = subprocess.run([sys.executable, "-m", "tests.helpers.slime_cli", str(tmp_path)],
                             cwd=slime_cli.REPO, env=env, capture_output=True, text=True,
                             timeout=600)
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith("SLIME_CLI ")]
        assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-3000:]
        got = json.loads(lines[-1].removeprefix("SLIME_CLI "))
    assert (got["qrl_loss_kind"], got["qrl_loss_tis_cap"], got["loss_type"]) == (
        "acr", 3.0, "custom_loss")
    assert got["qrl_aqn_enabled"] and got["qrl_error_tokens_action"] == "mask"
    assert got["sglang_mem_fraction_static"] == 0.3 and got["colocate"]
    assert (got["num_layers"], got["num_experts"], got["layernorm_epsilon"]) == (1, 8, 1e-6)
    assert got["custom_megatron_init_path"] == o.INIT_PATH
    assert got["custom_megatron_before_train_step_hook_path"] == o.BEFORE_TRAIN_STEP_PATH
    assert got["rollout_data_postprocess_path"] == o.POSTPROCESS_PATH


def _cp2_body(rank, world_size, port, kinds):
    """One rank of CP = 2: slime's zigzag slices of the logits and of every per-token input."""
    import datetime

    import torch.distributed as dist
    from megatron.core import parallel_state
    from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp, slice_with_cp
    from slime.backends.megatron_utils.loss import loss_function

    from megatron_qrl.compat import cpu_device_mode, enable_cpu_megatron

    enable_cpu_megatron()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    out = {}
    try:
        with cpu_device_mode():
            for kind in kinds:
                batch, logits, _ = packed_batch(seed=30 + KINDS.index(kind))
                starts = [sum(batch["total_lengths"][:i]) for i in range(len(PROMPTS))]
                spans = [(s, s + t) for s, t in zip(starts, batch["total_lengths"])]
                local = torch.cat([slice_with_cp(logits[0, a:b].detach(), 0.0) for a, b in spans])
                index = torch.cat([slice_with_cp(torch.arange(a, b), -1) for a, b in spans])
                local = local[None].clone().requires_grad_()
                cp = dict(batch)
                for key in ("log_probs", "rollout_log_probs", "advantages", "ref_log_probs"):
                    cp[key] = [slice_log_prob_with_cp(x, t, r) for x, t, r in
                               zip(batch[key], batch["total_lengths"], batch["response_lengths"])]
                args = slime_args(qrl_loss_kind=kind, qrl_loss_aggregation="seq_mean_token_mean",
                                  qrl_loss_kl_coef=0.05, ref_load="/ref")
                loss, _, _ = loss_function(args, cp, 1, len(PROMPTS), local)
                loss.backward()
                out[kind] = {"loss": loss.detach(), "grad": local.grad[0], "index": index}
            from megatron_qrl.integrations.slime.postprocess import qrl_rollout_data_postprocess

            data, _ = error_token_data()
            for key in ("log_probs", "rollout_log_probs"):
                data[key] = [slice_log_prob_with_cp(x, t, r) for x, t, r in
                             zip(data[key], data["total_lengths"], data["response_lengths"])]
            qrl_rollout_data_postprocess(slime_args(
                qrl_loss_aggregation="seq_mean_token_mean", qrl_error_tokens_action="mask",
                rollout_data_postprocess_path=POSTPROCESS), 0, data)
            out["error_masks"] = data["loss_masks"]
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return out


@pytest.mark.slow
def test_custom_loss_with_context_parallel_2_equals_cp1():
    """CP = 2 (slime's zigzag layout, two gloo ranks): the mean of the ranks' losses and the
    ranks' gradients (averaged as Megatron does over the DP x CP group) equal the CP = 1
    reference on the whole sequences, for every kind (tbpo gathers whole sequences); the
    error-token post-process gives the CP = 1 masks."""
    from tests.helpers.mp_utils import run_distributed

    results = run_distributed(_cp2_body, 2, KINDS, timeout_s=600)
    _, want_masks = error_token_data()  # the error-token post-process gathers over CP too
    for r in results:
        assert all(torch.equal(g, w) for g, w in zip(r["error_masks"], want_masks))
    for kind in KINDS:
        batch, logits, pad = packed_batch(seed=30 + KINDS.index(kind))
        want, _ = reference(pad, kind, "seq_mean_token_mean", 0.05)
        (grad_want,) = torch.autograd.grad(want, logits)
        got = sum(r[kind]["loss"] for r in results) / 2
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=kind)
        for r in results:
            owned = r[kind]["index"] >= 0
            torch.testing.assert_close(r[kind]["grad"][owned] / 2,
                                       grad_want[0, r[kind]["index"][owned]],
                                       rtol=1e-4, atol=1e-7, msg=kind)


def test_launcher_loads_train_py(monkeypatch, tmp_path):
    """slime's train.py is loaded from $SLIME_TRAIN_PY (else beside the slime package; its
    imports need wandb / sglang, so the real one loads on the GPU image only)."""
    from megatron_qrl.integrations.slime.launch import slime_train

    script = tmp_path / "train.py"
    script.write_text("def train(args):\n    return ('trained', args)\n")
    monkeypatch.setenv("SLIME_TRAIN_PY", str(script))
    assert slime_train()(7) == ("trained", 7)
    monkeypatch.setenv("SLIME_TRAIN_PY", str(tmp_path / "missing.py"))
    with pytest.raises(FileNotFoundError, match="SLIME_TRAIN_PY"):
        slime_train()
