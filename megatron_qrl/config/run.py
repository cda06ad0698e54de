"""Run-level configs of the RL loop; each field's docstring is its ``--qrl-*`` help.

Flags (prefix in brackets): RolloutConfig [rollout; its ``sglang`` field, an
:class:`~megatron_qrl.rollout_sglang.options.SGLangOptions`, [rollout-sglang]], TrainForwardConfig [train],
RoutingReplayConfig [routing], UAQConfig [uaq], TaskConfig [task], RunConfig [none].
Each ``__post_init__`` checks its own fields; combinations are checked by
:func:`megatron_qrl.config.validate_qrl_args`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Literal

from ..quant import get_spec, list_specs
from ..quant.uaq import validate_uaq_scale
from ..rollout_sglang.options import SGLangOptions
from .presets import preset_names

__all__ = [
    "RolloutConfig",
    "RoutingReplayConfig",
    "RunConfig",
    "TaskConfig",
    "TrainForwardConfig",
    "UAQConfig",
]


MAX_SEED = 2**63 - 1
"""Largest ``--qrl-seed``: torch's generators take a signed 64-bit seed."""


def _int(flag: str, value: object, minimum: int) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{flag} must be an integer >= {minimum}, got {value!r}")


def _real(flag: str, value: object, low: float, high: float = math.inf,
          low_open: bool = False) -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    ok = ok and math.isfinite(float(value)) and float(value) <= high
    ok = ok and (float(value) > low if low_open else float(value) >= low)
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"{flag} must be a finite number in {bracket}{low}, {high}], got {value!r}")


def _choice(flag: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")


@dataclass
class RolloutConfig:
    """How the rollout engine samples: format, engine, sampling parameters."""

    format: str = field(default="bf16", metadata={"choices": list_specs})
    """QuantSpec format of the rollout weights (megatron_qrl.quant registry); the same spec
    drives weight sync and the aligned training forward."""

    engine: Literal["reference", "sglang"] = "reference"
    """Rollout engine: reference (transformers model on CPU/GPU, weights from the packed
    tensors) or sglang (GPU)."""

    num_engines: int = 1
    """Rollout engines (Ray modes): N engine actors, one placement-group bundle each, prompt
    groups spread over them, weights broadcast to all at once (megatron_qrl.rollout.fleet);
    sampling is seeded per prompt group, so the batch does not depend on N (SGLang engines:
    with --qrl-rollout-sglang-deterministic only). 1: the single engine actor."""

    engine_tp: int = 1
    """Tensor-parallel size of each SGLang engine of the fleet (its GPUs, one node)."""

    engine_ep: int = 1
    """Expert-parallel size of each SGLang engine (divides --qrl-rollout-engine-tp: SGLang's EP
    group is made of the engine's TP ranks)."""

    engine_dp_attention: bool = False
    """SGLang DP attention in each engine of engine TP > 1 (MoE models): attention runs
    data-parallel over the engine's TP ranks (SGLang dp_size = engine TP), experts stay
    TP / EP; for MoE models whose KV heads are fewer than the engine TP."""

    n_samples_per_prompt: int = 8
    """Group size G: responses sampled per prompt (GRPO groups)."""

    max_new_tokens: int = 1024
    """Maximum number of generated tokens per response."""

    temperature: float = 1.0
    """Sampling temperature (> 0; RL samples at 1.0 so log-probs are the policy's)."""

    top_p: float = 1.0
    """Nucleus sampling: keep the smallest token set with probability >= top_p (1 = off)."""

    top_k: int = -1
    """Keep the top_k most likely tokens (-1 = off)."""

    stop: tuple[str, ...] = ()
    """Stop strings: generation of a response ends after the first one it produces."""

    sglang: SGLangOptions = field(default_factory=SGLangOptions)
    """SGLang engine options (--qrl-rollout-sglang-*: sync path and speed options, placement,
    memory), passed whole to the engine."""


    nvfp4_w4a4: bool = False
    """NVFP4 rollouts with FP4 activations too (W4A4); needs a Blackwell GPU (compute
    capability >= 10). Off: NVFP4 is weight-only (W4A16, Marlin on Hopper)."""

    def __post_init__(self) -> None:
        if self.format not in list_specs():
            raise ValueError(f"--qrl-rollout-format {self.format!r} is not a registered "
                             f"QuantSpec; choose one of {', '.join(list_specs())}")
        _choice("--qrl-rollout-engine", self.engine, ("reference", "sglang"))
        if not isinstance(self.sglang, SGLangOptions):
            raise TypeError(f"RolloutConfig.sglang must be SGLangOptions, got {self.sglang!r}")
        _int("--qrl-rollout-n-samples-per-prompt", self.n_samples_per_prompt, 1)
        _int("--qrl-rollout-max-new-tokens", self.max_new_tokens, 1)
        _real("--qrl-rollout-temperature", self.temperature, 0.0, low_open=True)
        _real("--qrl-rollout-top-p", self.top_p, 0.0, 1.0, low_open=True)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or (
                self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"--qrl-rollout-top-k must be -1 (off) or >= 1, got {self.top_k!r}")
        self.stop = tuple(self.stop)
        from ..rollout.fleet_layout import fleet_layout  # (kept out of the import block)

        fleet_layout(self.num_engines, self.engine_tp, self.engine_ep, self.engine)
        if self.engine_dp_attention and self.engine_tp == 1:
            raise ValueError("--qrl-rollout-engine-dp-attention spreads attention over the "
                             "engine's TP ranks: it needs --qrl-rollout-engine-tp > 1")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"--qrl-rollout-stop strings must be non-empty, got {self.stop!r}")

    @property
    def spec(self):
        """The QuantSpec named by ``format``."""
        return get_spec(self.format)


MOE_EXPERTS = ("megatron", "stacked")
ALIGNED_GEMMS = ("auto", "fake", "real")
"""``--qrl-train-moe-experts`` choices (``TrainForwardConfig.moe_experts``)."""
ALIGNED_BACKWARDS = ("bf16", "fp8")
"""``--qrl-train-aligned-backward`` choices (``te_quant.fp8_backward.BACKWARDS``)."""


@dataclass
class TrainForwardConfig:
    """Which forward the trainer runs for pi_prox recompute and the update."""

    forward: Literal["bf16", "aligned"] = "bf16"
    """bf16: plain BF16 forward. aligned: QaRL rollout-aligned forward, every quantized linear
    uses exactly the rollout's quantized weights (and activation quantization for W8A8),
    straight-through to the BF16 masters; needs a quantized --qrl-rollout-format."""

    moe_fast_path: bool = field(default=False, metadata={"on_resume": "may change"})
    """MoE models on a GPU with Transformer Engine: grouped-GEMM experts, alltoall dispatcher,
    fused permute, selective recompute of the experts' activation (Megatron flags after '--'
    win); elsewhere (no TE / GPU, LoRA) the experts run sequentially and the log says so."""

    moe_experts: Literal["megatron", "stacked"] = "megatron"
    """MoE routed experts. megatron: the spec's (TEGroupedMLP with --moe-grouped-gemm, else
    SequentialMLP). stacked: one [experts, out, in] weight per GEMM and one torch grouped GEMM
    per forward (torch._grouped_mm), no per-expert host work, no Transformer Engine needed;
    checkpoints and HF names stay per expert (models/stacked_experts.py). Not with LoRA. The
    qwen3-30b-a3b preset sets stacked (measured on the local spec only, docs/BENCHMARKS.md)."""

    aligned_gemm: Literal["auto", "fake", "real"] = field(
        default="auto", metadata={"on_resume": "may change"})
    """GEMM of the aligned forward. fake: dequantized weights and activations in a BF16 GEMM.
    real: the rollout's codes and scales in a low-bit GEMM (fp8: torch._scaled_mm, CUDA
    sm >= 89; int8: torch._int_mm, CUDA); an error where this device or format has none.
    auto: real where supported, else fake (CPU: fake). Same forward up to rounding; the
    backward is BF16 straight-through unless --qrl-train-aligned-backward fp8."""

    aligned_backward: Literal["bf16", "fp8"] = field(
        default="bf16", metadata={"on_resume": "may change"})
    """Input-gradient GEMM of the aligned linears on the real GEMM. bf16: straight-through
    BF16 (dx = g @ deq Q(W)). fp8: the gradient quantized per token to E4M3 (the weight's
    per-channel scale folded in) times the cached FP8 weight codes in torch._scaled_mm (the
    weight gradient: --qrl-train-aligned-wgrad). Needs the real GEMM (--qrl-train-aligned-gemm real, or auto on
    a GPU) of a per-channel FP8 format (fp8); effect on the gradient: docs/BENCHMARKS.md."""

    aligned_wgrad: Literal["bf16", "fp8"] = field(
        default="bf16", metadata={"on_resume": "may change"})
    """Weight-gradient GEMM of the aligned linears on the real GEMM. bf16: straight-through
    BF16 (dW = g^T @ deq Q(x)). fp8: the gradient, with the forward's per-token activation scale
    folded into its rows, quantized per output channel to E4M3, times the forward's saved FP8
    activation codes in torch._scaled_mm (no second quantization of x). Needs the real GEMM of
    a per-token FP8 format (fp8); effect on the gradient: docs/BENCHMARKS.md."""

    aligned_keep_dequantized: bool = field(default=False, metadata={"on_resume": "may change"})
    """The real GEMM's Q(W) cache also keeps each weight dequantized to BF16 from the first
    backward of an optimizer step to the next step, instead of dequantizing every weight again
    in each micro batch's backward (same gradient bits). Costs 2 bytes per weight element: all
    local experts of Qwen3-30B-A3B are 1.21 GB per layer (58 GB for 48 layers, divided by the
    expert-parallel size). Needs --qrl-train-forward aligned on the real GEMM."""

    def __post_init__(self) -> None:
        _choice("--qrl-train-forward", self.forward, ("bf16", "aligned"))
        _choice("--qrl-train-moe-experts", self.moe_experts, MOE_EXPERTS)
        _choice("--qrl-train-aligned-gemm", self.aligned_gemm, ALIGNED_GEMMS)
        _choice("--qrl-train-aligned-backward", self.aligned_backward, ALIGNED_BACKWARDS)
        _choice("--qrl-train-aligned-wgrad", self.aligned_wgrad, ALIGNED_BACKWARDS)
        if self.aligned_backward != "bf16" and (self.forward != "aligned"
                                                or self.aligned_gemm == "fake"):
            raise ValueError(
                f"--qrl-train-aligned-backward {self.aligned_backward} needs "
                "--qrl-train-forward aligned with --qrl-train-aligned-gemm real or auto (got "
                f"{self.forward} / {self.aligned_gemm}); use --qrl-train-aligned-backward bf16")
        if self.aligned_wgrad != "bf16" and (self.forward != "aligned"
                                             or self.aligned_gemm == "fake"):
            raise ValueError(
                f"--qrl-train-aligned-wgrad {self.aligned_wgrad} needs --qrl-train-forward "
                "aligned with --qrl-train-aligned-gemm real or auto (got "
                f"{self.forward} / {self.aligned_gemm}); use --qrl-train-aligned-wgrad bf16")
        if self.aligned_keep_dequantized and (self.forward != "aligned"
                                              or self.aligned_gemm == "fake"):
            raise ValueError(
                "--qrl-train-aligned-keep-dequantized keeps the real GEMM's dequantized weights: "
                "it needs --qrl-train-forward aligned with --qrl-train-aligned-gemm real or auto "
                f"(got {self.forward} / {self.aligned_gemm}); drop the flag")


@dataclass
class RoutingReplayConfig:
    """MoE routing replay: reuse the rollout's top-k experts in the trainer forward."""

    replay: Literal["off", "recompute", "all"] = "off"
    """off; recompute (pi_prox recompute only); all (recompute and the update forward).
    MoE models only."""

    def __post_init__(self) -> None:
        _choice("--qrl-routing-replay", self.replay, ("off", "recompute", "all"))


@dataclass
class UAQConfig:
    """UAQ (QuRL eq. 10-12): invariant rescaling applied once before RL."""

    scale: float = 1.0
    """UAQ scale s: norm gains * s, the linears they feed / s (QuRL uses 1.5 at lr < 1e-5).
    1 = off."""

    def __post_init__(self) -> None:
        validate_uaq_scale(self.scale)

    @property
    def enabled(self) -> bool:
        return self.scale != 1.0


@dataclass
class TaskConfig:
    """Prompts and reward: a JSONL prompt file or the built-in synthetic addition task."""

    prompts: str | None = None
    """JSONL file with one {"prompt": ..., "answer": ...} object per line; none = the
    synthetic multi-digit addition task below."""

    digits_min: int = 1
    """Synthetic addition: fewest digits of an operand."""

    digits_max: int = 3
    """Synthetic addition: most digits of an operand."""

    num_prompts: int = 512
    """Synthetic addition: number of distinct prompts generated (seeded by --qrl-seed)."""

    format_bonus: float = 0.1
    """Reward for a well-formatted response (rlquant study: 1.0 correct + 0.1 format, so
    rewards are in {0, 0.1, 1.1}); 0 disables."""

    demo_noise: float = 0.0
    """Fraction of the supervised warm-up's demonstrations with a spurious trailing "0"
    (ten times the answer; drawn anew for each demonstration, data/synthetic.py); the RL
    reward always checks the true answer. The CPU default job uses 0.5: the warm-up learns
    the habit, RL has to drop it."""

    def __post_init__(self) -> None:
        _int("--qrl-task-digits-min", self.digits_min, 1)
        _int("--qrl-task-digits-max", self.digits_max, 1)
        if self.digits_max < self.digits_min:
            raise ValueError(f"--qrl-task-digits-max ({self.digits_max}) must be >= "
                             f"--qrl-task-digits-min ({self.digits_min})")
        if self.digits_max > 18:
            raise ValueError(f"--qrl-task-digits-max must be <= 18, got {self.digits_max}")
        _int("--qrl-task-num-prompts", self.num_prompts, 1)
        _real("--qrl-task-format-bonus", self.format_bonus, 0.0, 1.0)
        _real("--qrl-task-demo-noise", self.demo_noise, 0.0, 1.0)
        if self.prompts is not None and not (isinstance(self.prompts, str) and self.prompts):
            raise ValueError(f"--qrl-task-prompts must be a file path, got {self.prompts!r}")


@dataclass
class RunConfig:
    """Run length, optimisation, batches, seed, output and checkpoints."""

    preset: str | None = None
    """Named flag set(s) applied before the user's flags (user flags win); a comma-separated
    list applies several in order, later ones winning (e.g. qwen3-4b-1gpu,qurl). Names:
    tiny-cpu, qwen3-4b-1gpu, qwen3-30b-a3b, qurl, qerl, rlquant-qaft, rlquant-qlora, qarl."""

    model: Literal["tiny-moe", "tiny-dense", "checkpoint"] = "tiny-moe"
    """tiny-moe / tiny-dense: the built-in tiny Qwen3(-MoE) sized for the char tokenizer
    (CPU job); checkpoint: start from --qrl-checkpoint."""

    checkpoint: str | None = None
    """Model to start from with --qrl-model checkpoint: an HF directory (config.json +
    *.safetensors) or a megatron_qrl checkpoint (megatron_qrl.json + hf/ + model/)."""

    steps: int = field(default=100, metadata={"on_resume": "may change"})
    """Number of RL steps (one rollout batch and its optimizer update(s) each)."""

    sft_steps: int = 0
    """Supervised warm-up steps on the task's answers before RL (0 = none)."""

    lr: float = 1e-6
    """Learning rate of the RL phase (Adam)."""

    sft_lr: float = 1e-3
    """Learning rate of the supervised warm-up."""

    prompts_per_step: int = 16
    """Prompts per RL step; the rollout batch holds prompts_per_step * n_samples_per_prompt
    responses."""

    micro_batch_size: int = 8
    """Responses per trainer forward/backward micro batch."""

    max_tokens_per_micro_batch: int = 0
    """RL steps: form the trainer's micro batches by this token budget (rows x longest row,
    samples sorted by length, each micro batch cut to its longest row) instead of
    --qrl-micro-batch-size padded rows; the policy loss is then the global token mean of each
    optimizer step (needs --qrl-loss-aggregation token_mean). 0 = off."""

    pack_sequences: bool = False
    """Run each trainer micro batch packed (THD): its samples' tokens back to back in one row
    with megatron-core PackedSeqParams (cu_seqlens), position ids and RoPE restarting per
    sample, attention causal within each sample (Transformer Engine's flash attention, or the
    local spec's SDPA attention segment by segment); no padding runs through the layers. Works
    with --qrl-micro-batch-size and with --qrl-max-tokens-per-micro-batch; losses and
    log-probs equal the padded path's. Not with --qrl-train-forward aligned +
    --qrl-rollout-kv-cache (the KV-cache-aligned attention is padded-only)."""

    log_prob_max_tokens: int = 0
    """RL steps: the pi_prox recompute (forward only, no activations kept) runs on
    consecutive trainer micro batches joined up to this many tokens (rows x longest row;
    the right padding changes no earlier logit), fewer and larger forwards; 0 = on the
    training micro batches."""

    prox_from_first_update: bool | None = field(default=None, metadata={"on_resume": "may change"})
    """RL steps: the first optimizer step's pi_prox is its own forward's log-probs (detached)
    instead of a separate recompute pass — its weights are pi_prox's, so only float noise
    differs; the recompute then runs on the other --qrl-updates-per-step - 1 mini batches
    only (none with one update, as slime skips its compute_log_prob pass when a rollout
    batch is one optimizer step: can_reuse_log_probs_in_loss). Unset (auto): on, unless the
    update forward is not pi_prox's forward — --qrl-routing-replay recompute (the update does
    not replay the rollout's routing) or --qrl-lora-dropout > 0 (the update drops adapter
    inputs) — where the run log says so in one line and every mini batch is recomputed.
    Asked for with one of those: an error. --no-qrl-prox-from-first-update: always the
    recompute pass."""

    updates_per_step: int = 1
    """Optimizer steps per rollout batch (mini batches); > 1 makes pi_theta move away from
    pi_prox within a step, which is what the clipping acts on."""

    seed: int = 1234
    """Seed of the model init, task generation, sampling and AQN noise."""

    output_dir: str | None = field(default=None, metadata={"on_resume": "may change"})
    """Directory for metrics.jsonl, plots and checkpoints; none = qrl_runs/<preset>-seed<seed>
    (printed at start; ',' in the preset becomes '+')."""

    tensorboard: bool = field(default=True, metadata={"on_resume": "may change"})
    """Also write every numeric metric as a TensorBoard scalar (tag = metric name, step = the
    record's step); needs the tensorboard package (without it one line says so and the run
    goes on). --no-qrl-tensorboard turns it off."""

    tensorboard_dir: str | None = field(default=None, metadata={"on_resume": "may change"})
    """Directory of the TensorBoard event files; none = <output-dir>/tensorboard."""

    save_interval: int = field(default=0, metadata={"on_resume": "may change"})
    """Save an (atomic) checkpoint every N steps of each phase (SFT and RL steps each counted
    from their phase's first step), at the end of SFT and at the end; 0 = only at the end of
    SFT and of the run (and when SIGINT / SIGTERM stop it); -1 = never (benchmarks, smoke
    runs: a Qwen3-4B checkpoint with its Adam state is ~70 GB)."""

    resume: bool = field(default=False, metadata={"on_resume": "may change"})
    """Resume from the newest intact checkpoint in the output directory (reproduces the next
    step exactly on CPU); a run that stopped before its first checkpoint starts again. Without
    it a used output directory is refused."""

    resume_allow_missing_metrics: bool = field(default=False, metadata={"on_resume": "may change"})
    """With --qrl-resume: go on when metrics.jsonl lacks steps before the checkpoint (deleted
    or cut short; the curves and the summary then lack them). Without it such a resume is
    refused."""

    max_bad_steps: int = field(default=3, metadata={"on_resume": "may change"})
    """Steps whose loss or gradient norm is NaN / inf skip their optimizer update (logged,
    counted in the metrics bad_updates / bad_steps_total); one more bad step than this stops
    the run, naming the step and the metric, before broken weights reach the engine (0: stop
    at the first)."""

    max_update_ratio: float = field(default=0.0, metadata={"on_resume": "may change"})
    """An optimizer update whose norm exceeds this multiple of the weights' norm (or that
    leaves a NaN / inf weight) is undone — parameters and optimizer state back to before the
    step — and counted as a bad step like a NaN gradient. It keeps one more copy of the
    parameters and the optimizer state on their device (a Qwen3-4B trainer: ~56 GB more), so
    it is off by default (0) and on in the tiny-cpu preset (10); the weight sync refuses
    non-finite weights either way."""

    ray_weight_transport: Literal["auto", "broadcast", "objectstore", "ipc"] = field(default="auto",
        metadata={"on_resume": "may change"})
    """Ray modes: how weights reach the engine actor. ipc: each bucket stays in memory the
    actor opens in place (CUDA IPC on the shared GPU, shared memory on CPU), only a small
    handle is sent; needs the engine on the trainer's node and device (--qrl-mode
    colocated). broadcast: a process group of the driver and the actor (NCCL for an SGLang
    engine on a GPU of its own, else gloo), one broadcast per bucket; objectstore: every
    bucket ray.put into the object store (a full copy of the weights there per sync). auto:
    ipc for a colocated engine on the trainer's device, else broadcast."""

    ray_weight_timeout_s: float = field(default=300.0, metadata={"on_resume": "may change"})
    """Ray modes, broadcast and ipc transports: timeout of the weight group's rendezvous and
    of each broadcast (ipc: of each bucket handle and the actor's answer). A dead actor fails a broadcast at once; one that hangs is restarted after
    this long (keep it above the longest gap between two buckets of a sync)."""

    engine_max_restarts: int = field(default=2, metadata={"on_resume": "may change"})
    """Ray modes: restarts of the rollout engine actor allowed within one call (a rollout,
    a weight sync) before the job fails."""

    trainer_sleep: Literal["auto", "on", "off"] = field(default="auto",
                                                       metadata={"on_resume": "may change"})
    """Put the trainer to sleep while the engine decodes (rl.trainer_sleep): its fp32 main
    parameters and optimizer state copied to (pinned) host memory and its gradient buffers
    released before each weight sync (the engine resumes beside the BF16 weights, which the
    sync reads) and through the rollout, restored bit for bit after it (the state behind the
    weights, overlapping the recompute and forward / backward), so an engine on the trainer's
    GPU can be given a larger --qrl-rollout-sglang-mem-fraction. auto: on for an
    SGLang engine on a GPU in --qrl-mode single (with its memory release) or colocated, off
    otherwise. on: also with the reference engine or on CPU (the same copies, into host
    memory); not with --qrl-mode disaggregated. Costs a copy of the optimizer state each way
    per step (time_sleep_s / time_wake_s in metrics.jsonl)."""

    profile_step: int = field(default=-1, metadata={"on_resume": "may change"})
    """The RL step (its ``step`` in metrics.jsonl) whose trainer phases — wake, pi_prox
    recompute, updates — run under torch.profiler; its record gets ``profile``: wall vs GPU
    kernel time, the top kernels and host ops, the host syncs, the caching allocator's
    cudaMalloc / cudaFree (each a host stall), the wall of ``qrl.recompute`` / ``qrl.train``.
    Costs that step's speed (the profiler's overhead); -1 = none."""

    profile_trace: bool = field(default=False, metadata={"on_resume": "may change"})
    """With --qrl-profile-step: also write that step's Chrome trace to
    <output-dir>/profile_step<N>.json (chrome://tracing, Perfetto; large: tens of MB per
    micro batch of a big model)."""

    def __post_init__(self) -> None:
        if self.preset is not None:
            preset_names(self.preset)  # raises naming the unknown preset
        _choice("--qrl-model", self.model, ("tiny-moe", "tiny-dense", "checkpoint"))
        if self.model == "checkpoint" and not self.checkpoint:
            raise ValueError("--qrl-model checkpoint needs --qrl-checkpoint DIR")
        if self.model != "checkpoint" and self.checkpoint:
            raise ValueError(f"--qrl-checkpoint is given but --qrl-model is {self.model}; "
                             "add --qrl-model checkpoint (or drop --qrl-checkpoint)")
        for flag, value, low in (("--qrl-steps", self.steps, 0),
                                 ("--qrl-sft-steps", self.sft_steps, 0),
                                 ("--qrl-prompts-per-step", self.prompts_per_step, 1),
                                 ("--qrl-micro-batch-size", self.micro_batch_size, 1),
                                 ("--qrl-updates-per-step", self.updates_per_step, 1),
                                 ("--qrl-max-tokens-per-micro-batch",
                                  self.max_tokens_per_micro_batch, 0),
                                 ("--qrl-log-prob-max-tokens", self.log_prob_max_tokens, 0),
                                 ("--qrl-seed", self.seed, 0),
                                 ("--qrl-save-interval", self.save_interval, -1),
                                 ("--qrl-engine-max-restarts", self.engine_max_restarts, 0),
                                 ("--qrl-max-bad-steps", self.max_bad_steps, 0),
                                 ("--qrl-profile-step", self.profile_step, -1)):
            _int(flag, value, low)
        if self.seed > MAX_SEED:
            raise ValueError(f"--qrl-seed must be at most 2**63 - 1 = {MAX_SEED} (torch's "
                             f"generators take a signed 64-bit seed), got {self.seed}")
        _real("--qrl-lr", self.lr, 0.0, low_open=True)
        _real("--qrl-sft-lr", self.sft_lr, 0.0, low_open=True)
        _real("--qrl-max-update-ratio", self.max_update_ratio, 0.0)
        _choice("--qrl-ray-weight-transport", self.ray_weight_transport,
                ("auto", "broadcast", "objectstore", "ipc"))
        _real("--qrl-ray-weight-timeout-s", self.ray_weight_timeout_s, 0.0, low_open=True)
        _choice("--qrl-trainer-sleep", self.trainer_sleep, ("auto", "on", "off"))

    def resolved_output_dir(self) -> str:
        """``output_dir``, or the deterministic default ``qrl_runs/<preset>-seed<seed>``."""
        name = (self.preset or "custom").replace(",", "+")
        return self.output_dir or f"qrl_runs/{name}-seed{self.seed}"
