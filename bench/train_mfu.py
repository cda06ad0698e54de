#!/usr/bin/env python3
"""The trainer phases of an RL step (pi_prox recompute + updates), trainer settings side by side.

    python bench/train_mfu.py --model qwen3_4b --rows full-mb4-oldlp-norope,full-mb4,none-mb4 \
        --out $OUT/train_mfu.jsonl
    python bench/train_mfu.py --device cpu --model tiny --prompts 2 --n 4 --new-tokens 16
    python bench/train_mfu.py --pick $OUT/train_mfu.jsonl     # rl_step.py flags of the best row

One process builds the policy once through ``rl.trainer.build_policy`` (BF16 + fp32 Adam,
the TE spec where TE imports on a GPU, random init: speed does not depend on the weights) and
one rollout-shaped batch (``--prompts`` x ``--n`` samples of ``--prompt-len`` +
``--new-tokens`` tokens, a ``--full-frac`` share of them at full length as a random-weight
model's rollouts are, the rest uniform; random token ids). Each row then runs what
``rl.steps.rl_step`` runs between rollout and sync — ``PolicyTrainer.log_probs`` over the
micro batches whose pi_prox is recomputed (``rl.steps.set_old_log_probs``), then ``--updates`` ``PolicyTrainer.train_step`` with the TIS loss of
``rl.steps.make_loss_fn`` — after one untimed warm-up micro batch. Rows (``-``-joined words):

    full | none      --recompute-granularity full --recompute-method uniform
                     --recompute-num-layers 1, or no activation recompute
    mbN | tokN       --qrl-micro-batch-size N, or --qrl-max-tokens-per-micro-batch N
    lpN              --qrl-log-prob-max-tokens N (the recompute on micro batches joined up
                     to N tokens; default: on the training micro batches)
    prox1 | prox0    --qrl-prox-from-first-update (no recompute of the first update's
                     samples: its own forward gives pi_prox) or --no-qrl-prox-from-first-update
                     (every micro batch recomputed); neither: qrl-train's default, which is
                     prox1 for this bench's model (no routing replay, no LoRA dropout)
    thd              --qrl-pack-sequences: each micro batch packed into one row (THD,
                     PackedSeqParams; no padding in the layers)
    gg | pf | rf     MoE: TE grouped-GEMM experts (--moe-grouped-gemm), fused permute
                     (--moe-permute-fusion), fused router (--moe-router-fusion); ag: the
                     allgather dispatcher (default: alltoall with TE), a2a: the alltoall one
                     (the default without TE is allgather)
    st               MoE: stacked experts (--qrl-train-moe-experts stacked: one [experts,
                     out, in] weight per GEMM, one torch._grouped_mm per GEMM; TE not needed).
    al | alk | alb   the rollout-aligned forward (--qrl-train-forward aligned,
                     --qrl-train-aligned-gemm auto: the real FP8 GEMMs on a GPU) for fp8
                     rollouts; alk: also --qrl-train-aligned-keep-dequantized; alb: for
                     fp8_block rollouts (dense linears on SGLang's block GEMM, experts fake)
    al8              al with both backward GEMMs in FP8 (--qrl-train-aligned-backward fp8
                     --qrl-train-aligned-wgrad fp8): every GEMM of the aligned linears FP8
    alw              the aligned forward for w4a16 rollouts (Q(W): int4 codes dequantized
                     once per optimizer step, BF16 GEMMs; no low-bit GEMM on Hopper)
    rp               routing replay (--qrl-routing-replay all) of random engine experts (each
                     token's top-k drawn at random, the batch carries them as a rollout does)
                     The MoE, aligned and replay words are build-time settings: rows are built
                     once per distinct set (in the order given), through qrl-train's own
                     ``rl.forward.forward_plan``
    oldlp            the earlier log-prob path (megatron-core's cross entropy on a fp32 copy +
                     a separate entropy pass; ``PolicyLossFunc(chunked=False)``)
    norope           --no-rope-fusion

Recompute and RoPE fusion are TransformerConfig fields Megatron reads at every forward, so a
row sets them on the built model's config (what the flags would have built). Reported per
row: times, ``trainer_mfu = 6 N tokens / t_train / 989 TFLOP/s`` and ``recompute_mfu = 2 N
tokens / t_recompute / peak`` (bench/rl_step.py's definitions: N the active parameters but the
input embedding, tokens the positions run, padding included; a ``thd`` row runs no padding), peak allocated / reserved
memory, allocator retries (``num_alloc_retries``: cudaFree + retry, a full-GPU symptom) and,
on CUDA, a kernel profile of two more micro batches (``prof_*``: the GPU's busy share of the
wall time — below ~0.9 the host, not the kernels, sets the pace — and the top kernels).
A row that runs out of memory is reported as such and the next one runs. First, one record
``log_prob_check``: the chunked log-probs, entropy and logit gradients against the earlier
megatron-core path on one micro batch of the model's own logits (max abs differences).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _runner import commit  # noqa: E402
from rl_step import PEAK_FLOPS, active_params, markdown_table  # noqa: E402

DEFAULT_ROWS = ("full-mb4-oldlp-norope-prox0,full-mb4-prox0,none-mb4-prox0,none-mb4-lp16512-prox1,"
                "none-mb8-lp16512-prox1,full-mb16-lp16512-prox1")
RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
COMMIT = commit()
STACKED = "qrl_stacked_experts"
"""The ``st`` word's key in ``Row.moe``: a spec hook (models.stacked_experts), not a config field."""
MOE_WORDS: dict[str, tuple[str, object]] = {
    "gg": ("moe_grouped_gemm", True), "pf": ("moe_permute_fusion", True),
    "rf": ("moe_router_fusion", True), "ag": ("moe_token_dispatcher_type", "allgather"),
    "a2a": ("moe_token_dispatcher_type", "alltoall"), "st": (STACKED, True)}
QRL_WORDS: dict[str, tuple[str, ...]] = {
    "al": ("--qrl-train-forward", "aligned", "--qrl-rollout-format", "fp8"),
    "alk": ("--qrl-train-forward", "aligned", "--qrl-rollout-format", "fp8",
            "--qrl-train-aligned-keep-dequantized"),
    "alb": ("--qrl-train-forward", "aligned", "--qrl-rollout-format", "fp8_block"),
    "al8": ("--qrl-train-forward", "aligned", "--qrl-rollout-format", "fp8",
            "--qrl-train-aligned-backward", "fp8", "--qrl-train-aligned-wgrad", "fp8"),
    "alw": ("--qrl-train-forward", "aligned", "--qrl-rollout-format", "w4a16"),
    "rp": ("--qrl-routing-replay", "all")}
"""Build-time ``--qrl-*`` words (aligned forward, routing replay) -> their flags."""
MOE_FLAGS = {("moe_grouped_gemm", True): "--moe-grouped-gemm",
             ("moe_permute_fusion", True): "--moe-permute-fusion",
             ("moe_router_fusion", True): "--moe-router-fusion",
             ("moe_token_dispatcher_type", "allgather"): "--moe-token-dispatcher-type allgather",
             ("moe_token_dispatcher_type", "alltoall"): "--moe-token-dispatcher-type alltoall"}


@dataclass(frozen=True)
class Row:
    """One trainer setting (module docstring)."""

    name: str
    recompute: bool
    micro_batch: int = 0
    max_tokens: int = 0
    chunked: bool = True
    rope_fusion: bool = True
    log_prob_tokens: int = 0
    prox_first: bool | None = None
    """prox1: True, prox0: False, neither: None (qrl-train's default: on here)."""
    thd: bool = False
    moe: tuple[tuple[str, object], ...] = ()
    """Build-time settings of the MoE words: ``TransformerConfig`` overrides (gg, pf, rf, ag,
    a2a) and :data:`STACKED` (st)."""
    qrl: tuple[str, ...] = ()
    """Build-time ``--qrl-*`` words (:data:`QRL_WORDS`: al, alk, alb, al8, alw, rp), in the order given."""

    @property
    def build(self) -> tuple:
        """What a built policy fixes: the MoE settings and the ``--qrl-*`` words."""
        return self.moe, self.qrl

    @property
    def replays(self) -> bool:
        return "rp" in self.qrl

    @classmethod
    def parse(cls, name: str) -> Row:
        words = name.split("-")
        if words[0] not in ("full", "none"):
            raise ValueError(f"row {name!r}: starts with full or none (activation recompute)")
        kw: dict = {"recompute": words[0] == "full"}
        moe: list[tuple[str, object]] = []
        qrl: list[str] = []
        for w in words[1:]:
            if w in MOE_WORDS:
                moe.append(MOE_WORDS[w])
                continue
            if w in QRL_WORDS:
                qrl.append(w)
                continue
            if w.startswith("mb") and w[2:].isdigit():
                kw["micro_batch"] = int(w[2:])
            elif w.startswith("tok") and w[3:].isdigit():
                kw["max_tokens"] = int(w[3:])
            elif w.startswith("lp") and w[2:].isdigit():
                kw["log_prob_tokens"] = int(w[2:])
            elif w in ("oldlp", "norope"):
                kw["chunked" if w == "oldlp" else "rope_fusion"] = False
            elif w in ("prox1", "prox0"):
                kw["prox_first"] = w == "prox1"
            elif w == "thd":
                kw["thd"] = True
            else:
                raise ValueError(f"row {name!r}: unknown word {w!r} (mbN, tokN, lpN, prox1, "
                                 "prox0, thd, oldlp, norope, gg, pf, rf, ag, a2a, st, al, "
                                 "alk, alb, al8, alw, rp)")
        if len({k for k, _ in moe}) < len(moe):
            raise ValueError(f"row {name!r}: ag and a2a exclude each other")
        if sum(w.startswith("al") for w in qrl) > 1:
            raise ValueError(f"row {name!r}: al, alk, alb, al8 and alw exclude each other")
        kw["moe"] = tuple(sorted(moe))
        kw["qrl"] = tuple(qrl)
        if bool(kw.get("micro_batch")) == bool(kw.get("max_tokens")):
            raise ValueError(f"row {name!r}: give exactly one of mbN / tokN")
        return cls(name, **kw)

    def rl_step_args(self) -> tuple[str, str, str]:
        """``(bench/rl_step.py micro-batch flags, its --megatron flags, its --qrl flags)``."""
        mb = f"--max-tokens-per-micro-batch {self.max_tokens}" if self.max_tokens \
            else f"--micro-batch-size {self.micro_batch}"
        meg = " ".join(([RECOMPUTE] if self.recompute else [])
                       + ([] if self.rope_fusion else ["--no-rope-fusion"])
                       + [MOE_FLAGS[kv] for kv in self.moe if kv in MOE_FLAGS])
        qrl = " ".join(([f"--qrl-log-prob-max-tokens {self.log_prob_tokens}"]
                        if self.log_prob_tokens else [])
                       + {True: ["--qrl-prox-from-first-update"], None: [],
                          False: ["--no-qrl-prox-from-first-update"]}[self.prox_first]
                       + (["--qrl-pack-sequences"] if self.thd else [])
                       + (["--qrl-train-moe-experts stacked"] if dict(self.moe).get(STACKED)
                          else [])
                       + [" ".join(QRL_WORDS[w]) for w in self.qrl])
        return mb, meg, qrl

    def qrl_flags(self) -> list[str]:
        """The ``--qrl-*`` flags the row's policy is built with (stacked experts, aligned
        forward, routing replay)."""
        out = ["--qrl-train-moe-experts", "stacked"] if dict(self.moe).get(STACKED) else []
        for w in self.qrl:
            out += QRL_WORDS[w]
        return out


def rollout_batch(args: argparse.Namespace, vocab: int,
                  routing: tuple[int, int, int] | None = None) -> dict:
    """A packed rollout batch (``rl.batch.pack_samples``) with GRPO advantages; ``routing``
    ``(MoE layers, experts, top-k)``: also the engine's experts of every token
    (``routed_experts``, distinct random ids), as a rollout for routing replay carries them."""
    from megatron_qrl.losses import grpo_advantages
    from megatron_qrl.rl.batch import pack_samples

    g = torch.Generator().manual_seed(0)
    b = args.prompts * args.n
    full = torch.rand(b, generator=g) < args.full_frac
    lengths = torch.where(full, args.new_tokens, torch.randint(1, args.new_tokens + 1, (b,),
                                                                generator=g))
    prompts = [torch.randint(1, vocab, (args.prompt_len,), generator=g).tolist()
               for _ in range(b)]
    responses = [torch.randint(1, vocab, (int(n),), generator=g).tolist() for n in lengths]
    lps = [-torch.rand(int(n), generator=g) * 3 for n in lengths]
    routed = None
    if routing is not None:
        layers, experts, k = routing
        width = args.prompt_len + args.new_tokens
        routed = torch.rand(b, width, layers, experts, generator=g).topk(k, dim=-1).indices
    batch = pack_samples(prompts, responses, lps, 0, routed)
    rewards = (torch.rand(b, generator=g) < 0.3).float()
    batch["advantages"] = grpo_advantages(rewards, torch.arange(args.prompts).repeat_interleave(
        args.n))
    return batch


def micro_batches(row: Row, batch: dict, updates: int) -> list[list[dict]]:
    """Each optimizer step's micro batches, as ``rl.steps.micro_batches`` forms them."""
    from megatron_qrl.rl.batch import split_batch
    from megatron_qrl.rl.microbatch import budget_micro_batches

    if row.max_tokens:
        return budget_micro_batches(batch, row.max_tokens, updates)
    b = batch["tokens"].shape[0]
    if b % (row.micro_batch * updates):
        raise ValueError(f"{b} samples do not split into {updates} updates of micro batches of "
                         f"{row.micro_batch}")
    mbs = split_batch(batch, row.micro_batch)
    per = len(mbs) // updates
    return [mbs[u * per:(u + 1) * per] for u in range(updates)]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _apply(policy, row: Row, fused_rope: bool) -> None:
    import dataclasses

    policy.options = dataclasses.replace(policy.options, pack_sequences=row.thd)
    cfg = policy.config
    cfg.recompute_granularity = "full" if row.recompute else None
    cfg.recompute_method = "uniform" if row.recompute else None
    cfg.recompute_num_layers = 1 if row.recompute else None
    cfg.apply_rope_fusion = fused_rope and row.rope_fusion


def _kernel_profile(fn, device: str = "cuda") -> dict:
    """GPU busy share of ``fn``'s wall time (CUPTI kernel times, one stream) and its top
    kernels: near 1 means the GPU kernels are the time, well below 1 that the host (Python /
    launches / syncs) leaves the GPU idle. (``device="cpu"``: CPU ops, nested ones counted
    twice — only to test this function where there is no GPU.)"""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    _sync()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        _sync()
    wall_us = (time.perf_counter() - t) * 1e6
    by_name: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == (DeviceType.CUDA if cuda else DeviceType.CPU):
            by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us()
    busy = sum(by_name.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:6]
    return {"busy_frac": round(busy / wall_us, 3), "wall_ms": round(wall_us / 1e3, 1),
            "top_ms": {k[:70]: round(v / 1e3, 1) for k, v in top}}


def _profiles(trainer, group: list[dict], loss_fn, per_token: bool) -> dict:
    """Kernel profiles of the recompute and the update of two micro batches (CUDA only)."""
    two = [dict(mb) for mb in group[:2]]
    try:
        return {"prof_recompute": _kernel_profile(lambda: trainer.log_probs(two, loss_fn)),
                "prof_train": _kernel_profile(
                    lambda: trainer.train_step(two, loss_fn, per_token_loss=per_token))}
    except Exception as exc:  # noqa: BLE001 (a profiler that cannot run is reported, not fatal)
        return {"prof_error": f"{type(exc).__name__}: {exc}"[:200]}


def check_log_probs(trainer, mb: dict) -> dict:
    """The chunked log-probs / entropy / logit gradients against the earlier megatron-core
    path on one micro batch of this model's real logits (max abs differences)."""
    from megatron_qrl.losses.logprobs import chunked_log_probs
    from megatron_qrl.losses.megatron_adapter import (
        _tp_group,
        megatron_log_probs,
        vocab_parallel_entropy,
    )

    device = next(trainer.module.parameters()).device
    tokens, labels = mb["tokens"].to(device), mb["labels"].to(device)
    with torch.no_grad():
        logits = trainer.module(tokens, mb["position_ids"].to(device), None)
    weights = torch.randn(labels.shape, generator=torch.Generator().manual_seed(1)).to(device)
    out = {}
    for name, fn in (("chunked", lambda x: chunked_log_probs(x, labels, 1.0, _tp_group())[0]),
                     ("megatron", lambda x: megatron_log_probs(x, labels))):
        x = logits.detach().requires_grad_()
        lp = fn(x)
        (grad,) = torch.autograd.grad((lp * weights).sum(), x)
        out[name] = (lp.detach(), grad.float())
        del x, lp, grad
    ent = chunked_log_probs(logits, labels, 1.0, _tp_group(), entropy=True)[1]
    ent_old = vocab_parallel_entropy(logits, _tp_group())
    (lp_a, g_a), (lp_b, g_b) = out["chunked"], out["megatron"]
    return {"row": "log_prob_check", "tokens": int(labels.numel()),
            "max_abs_dlogp": float((lp_a - lp_b).abs().max()),
            "max_abs_dentropy": float((ent - ent_old).abs().max()),
            "max_abs_dgrad": float((g_a - g_b).abs().max()),
            "max_abs_grad": float(g_b.abs().max())}


def run_row(trainer, row: Row, batch: dict, configs: dict, n_active: int, updates: int,
            fused_rope: bool, profile: bool = False, breakdown: bool = False) -> dict:
    """Recompute + ``updates`` optimizer steps of ``row``; its times, MFU and memory."""
    from megatron_qrl.config import QrlConfigs
    from megatron_qrl.losses.megatron_adapter import PolicyLossFunc
    from megatron_qrl.rl.micro_forward import positions_run
    from megatron_qrl.rl.steps import set_old_log_probs

    _apply(trainer.policy, row, fused_rope)
    loss_fn = PolicyLossFunc(configs["loss"], configs["error_tokens"],
                             temperature=configs["rollout"].temperature, chunked=row.chunked)
    groups = micro_batches(row, batch, updates)
    mbs = [mb for g in groups for mb in g]
    per_token = bool(row.max_tokens)
    warm = [dict(mbs[0])]  # untimed: kernels / cuDNN graphs / allocator of this shape
    warm[0]["old_log_probs"] = trainer.log_probs(warm, loss_fn)[0]
    trainer.train_step(warm, loss_fn, per_token_loss=per_token)
    cuda = torch.cuda.is_available()
    if cuda:
        _sync()
        torch.cuda.reset_peak_memory_stats()
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else 0
    t0 = time.perf_counter()
    run = SimpleNamespace(log_prob_max_tokens=row.log_prob_tokens)
    ctx = SimpleNamespace(configs=QrlConfigs(run=run), tokenizer=SimpleNamespace(pad_id=0),
                          trainer=trainer, loss_fn=loss_fn)
    recompute = set_old_log_probs(ctx, groups, row.prox_first is not False)  # as rl_step
    _sync()
    t1 = time.perf_counter()
    for g in groups:
        trainer.train_step(g, loss_fn, per_token_loss=per_token)
    _sync()
    t2 = time.perf_counter()
    pack = trainer.pack_multiple()
    tokens = sum(positions_run(mb, pack) for mb in mbs)
    again = sum(positions_run(mb, pack) for mb in recompute)
    plan = trainer.policy.plan
    rec = {"row": row.name, "qrl_flags": " ".join(row.qrl_flags()),
           "aligned_gemm": plan.aligned.gemm if plan.aligned is not None else None,
           "routing_agreement": trainer.last_routing_agreement,
           "micro_batches": len(mbs), "trained_tokens": tokens,
           "recomputed_tokens": again, "real_tokens": int(batch["loss_mask"].sum()),
           "time_recompute_s": round(t1 - t0, 3), "time_train_s": round(t2 - t1, 3),
           "trainer_mfu": round(6 * n_active * tokens / (t2 - t1) / PEAK_FLOPS, 4),
           "recompute_mfu": round(2 * n_active * again / max(t1 - t0, 1e-9) / PEAK_FLOPS, 4)}
    if cuda:
        rec.update(peak_alloc_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                   peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2),
                   alloc_retries=torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries)
        if profile:
            rec.update(_profiles(trainer, groups[0], loss_fn, per_token))
    if breakdown:
        from layer_profile import breakdown as parts

        one = [dict(groups[0][0])]
        rec["breakdown"] = parts(lambda: trainer.train_step(one, loss_fn,
                                                            per_token_loss=per_token),
                                 trainer.module)
        rec["breakdown_recompute"] = parts(lambda: trainer.log_probs([dict(one[0])], loss_fn),
                                           trainer.module)
    return rec


BASE_FLAGS = ("--qrl-loss-kind", "tis", "--qrl-rollout-engine", "reference",
              "--qrl-no-progress")
PLAIN_FLAGS = ("--qrl-train-forward", "bf16", "--qrl-routing-replay", "off")
"""The plain trainer (a row's words add to it): BF16 forward, no replay."""


def _configs() -> dict:
    from megatron_qrl.rl.cli import parse_configs

    return parse_configs(list(BASE_FLAGS))[0]


def _build(arch, row: Row, bf16: bool, impl: str = "auto"):
    """One policy (``rl.trainer.build_policy``) with ``row``'s build-time settings: the plan of
    its ``--qrl-*`` flags (:meth:`Row.qrl_flags`: stacked experts, aligned forward, routing
    replay) from qrl-train's ``rl.forward.forward_plan``, plus its MoE config overrides, and
    layer implementation ``impl``."""
    from megatron_qrl.rl.cli import parse_configs
    from megatron_qrl.rl.forward import forward_plan
    from megatron_qrl.rl.trainer import PolicyTrainer, TrainerOptions, build_policy

    overrides = {k: v for k, v in row.moe if k != STACKED}
    configs = parse_configs([*BASE_FLAGS, *PLAIN_FLAGS, *row.qrl_flags()])[0]
    plan = forward_plan(configs, arch)
    plan.config_overrides.update(overrides)
    return PolicyTrainer(build_policy(arch, 1e-6, plan, bf16=bf16,
                                      options=TrainerOptions(transformer_impl=impl)))


def _experts(module) -> str | None:
    """Class name of the model's first routed-experts module (None: a dense model)."""
    for name, sub in module.named_modules():
        if name.endswith("mlp.experts"):
            return type(sub).__name__
    return None


def _emit(args: argparse.Namespace, rec: dict) -> None:
    rec.setdefault("commit", COMMIT)
    print("[train_mfu] " + json.dumps(rec), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(args: argparse.Namespace, rows: list[Row]) -> list[dict]:
    """Build the policy once per distinct MoE build setting and run its rows (module
    docstring); each record is appended to ``--out`` as soon as its row is done (a call that
    times out keeps the rows so far)."""
    from megatron_qrl.models.hf_config import arch_from_dict
    from megatron_qrl.models.runtime import single_process_megatron

    name = "tiny_qwen3" if args.model == "tiny" else args.model
    path = Path(name) if Path(name).is_file() else ROOT / "megatron_qrl/data/configs" / f"{name}.json"
    cfg = json.loads(path.read_text())
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    arch = arch_from_dict(cfg, source=str(path))
    n_active, configs, out = active_params(cfg), _configs(), []
    builds = list(dict.fromkeys(r.build for r in rows))  # build-time settings, in order
    with single_process_megatron():
        for i, build in enumerate(builds):
            first = next(r for r in rows if r.build == build)
            t = time.perf_counter()
            trainer = _build(arch, first, bf16=args.device == "cuda", impl=args.transformer_impl)
            fused_rope = bool(trainer.policy.config.apply_rope_fusion)
            print(f"[train_mfu] built {args.model} ({cfg['num_hidden_layers']} layers, "
                  f"{n_active / 1e9:.2f} B active, TE spec: {fused_rope or 'no/unknown'}, "
                  f"build {dict(build[0]) or 'default'} {' '.join(first.qrl_flags())}) in "
                  f"{time.perf_counter() - t:.1f} s", flush=True)
            routing = ((arch.num_layers, arch.num_experts, arch.moe_top_k) if first.replays
                       else None)
            batch = rollout_batch(args, arch.vocab_size, routing)
            if i == 0:
                _emit(args, check_log_probs(trainer, {k: v[:4] for k, v in batch.items()}))
            for row in [r for r in rows if r.build == build]:
                try:
                    rec = run_row(trainer, row, batch, configs, n_active, args.updates,
                                  fused_rope, profile=args.profile, breakdown=args.breakdown)
                except torch.cuda.OutOfMemoryError as exc:
                    rec = {"row": row.name, "error": f"OOM: {str(exc).splitlines()[0][:160]}"}
                except ValueError as exc:
                    rec = {"row": row.name, "error": str(exc)}
                rec.update(model=args.model, layers=cfg["num_hidden_layers"],
                           transformer_impl=args.transformer_impl,
                           experts=_experts(trainer.module),
                           device=args.device, prompts=args.prompts, n=args.n,
                           new_tokens=args.new_tokens, updates=args.updates)
                _emit(args, rec)
                out.append(rec)
                _free()
            del trainer
            _free()
    return out


def pick(path: Path, max_peak_gib: float) -> tuple[str, str, str]:
    """bench/rl_step.py flags of the fastest row (recompute + train time) of ``path`` that ran
    without error, within ``max_peak_gib`` reserved and on the current code (no ``oldlp``)."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    ok = [r for r in rows if "time_train_s" in r and "oldlp" not in r["row"].split("-")
          and r.get("peak_reserved_gib", 0.0) <= max_peak_gib]
    if not ok:
        raise SystemExit(f"bench/train_mfu.py --pick: no row of {path} ran within "
                         f"{max_peak_gib} GiB")
    best = min(ok, key=lambda r: r["time_recompute_s"] + r["time_train_s"])
    return Row.parse(best["row"]).rl_step_args()


def _table(rows: list[dict]) -> str:
    cols = ("row", "micro_batches", "time_recompute_s", "time_train_s", "recompute_mfu",
            "trainer_mfu", "peak_alloc_gib", "peak_reserved_gib", "alloc_retries",
            "prof_recompute", "prof_train")
    return markdown_table(cols, [
        [r["row"], r["error"]] if "error" in r else [
            str(r.get(c, {}).get("busy_frac", "") if c.startswith("prof_") else r.get(c, ""))
            for c in cols]
        for r in rows])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3_4b", help="qwen3_4b | qwen3_30b_a3b | tiny | FILE")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: all)")
    p.add_argument("--rows", default=DEFAULT_ROWS, help="comma-separated rows (module docstring)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--full-frac", type=float, default=0.9,
                   help="share of responses at --new-tokens (the rest uniform in 1..max)")
    p.add_argument("--updates", type=int, default=2, help="optimizer steps per RL step (2: the "
                   "tiny-cpu preset's --qrl-updates-per-step and the 7ed221d rows; the "
                   "qwen3-4b-1gpu job runs 1, bench/h200.sh rlstep-mfu passes UPDATES=1)")
    p.add_argument("--transformer-impl", default="auto",
                   choices=("auto", "local", "transformer_engine"),
                   help="layer implementation (auto: TE where it imports on a GPU; local: "
                   "megatron-core's local spec with SDPA attention, no TE)")
    p.add_argument("--out", default=None, help="append the records here (JSONL)")
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help="skip the per-row kernel profile (CUDA: GPU busy share of the recompute "
                   "and the update of two micro batches, top kernels)")
    p.add_argument("--breakdown", action="store_true",
                   help="per row, GPU time of one train micro batch by model part (router, "
                   "dispatch / permute, experts, attention, norms, optimizer, recompute: "
                   "bench/layer_profile.py), printed as one table at the end")
    p.add_argument("--pick", default=None, metavar="JSONL",
                   help="print the rl_step.py micro-batch flags, --megatron flags and --qrl "
                   "flags (three lines) of the fastest row in JSONL, then exit")
    p.add_argument("--max-peak-gib", type=float, default=110.0,
                   help="--pick: rows above this reserved peak leave too little for the "
                   "engine's resume")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.pick:
        print("\n".join(pick(Path(args.pick), args.max_peak_gib)))
        return 0
    try:
        rows = [Row.parse(r.strip()) for r in args.rows.split(",") if r.strip()]
    except ValueError as exc:
        print(f"bench/train_mfu.py: --rows: {exc}", file=sys.stderr)
        return 2
    if (args.device == "cuda") != torch.cuda.is_available():
        print(f"bench/train_mfu.py: --device {args.device} but CUDA is "
              f"{'' if torch.cuda.is_available() else 'not '}available", file=sys.stderr)
        return 2
    if args.prompts * args.n % args.updates:
        print("bench/train_mfu.py: --prompts x --n must be a multiple of --updates",
              file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    records = measure(args, rows)
    print(_table(records))
    if args.breakdown:
        from layer_profile import table

        done = [r for r in records if "breakdown" in r]
        if done:
            print(table(done, done[0]["layers"]))
            print("[train_mfu] the log-prob recompute of one micro batch (no grad), by part:")
            print(table(done, done[0]["layers"], key="breakdown_recompute"))
    return 1 if all("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
