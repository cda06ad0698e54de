"""Megatron-LM training flags after ``--`` on the ``qrl-train`` command line.

megatron-core 0.16.1 ships no ``megatron.training``, so this module defines the SUBSET of
Megatron-LM's ``megatron/training/arguments.py`` flags that ``qrl-train`` understands, with
Megatron's exact names, dests and defaults (:data:`FLAGS`). When ``megatron.training.arguments``
IS importable its own parser reads them instead (:func:`megatron_parser`), and the same
mapping applies. Every accepted flag has an effect or raises; none is silently ignored:

* parallel layout: ``--tensor-model-parallel-size``, ``--expert-model-parallel-size``,
  ``--expert-tensor-parallel-size`` (Megatron default: equal to TP), ``--sequence-parallel``
  (off unless given, as in Megatron; MoE with TP > 1 needs it),
  ``--pipeline-model-parallel-size`` (megatron-core's 1F1B schedule, ``rl.pipeline``; its
  virtual / interleaved stages are refused), ``--bf16`` (below);
* trainer memory / speed (:meth:`MegatronSettings.trainer_options`): ``--transformer-impl``
  (``transformer_engine`` | ``local``; absent: TE where it imports on a GPU, as Megatron-LM
  defaults to it), ``--recompute-granularity`` / ``--recompute-method`` /
  ``--recompute-num-layers`` (TransformerConfig's activation recomputation, Megatron's
  checks), ``--use-distributed-optimizer`` (optimizer state sharded over data-parallel ranks;
  checkpoints hold each rank's shard), ``--optimizer-cpu-offload`` /
  ``--optimizer-offload-fraction`` (megatron-core's HybridDeviceOptimizer: that share of the
  fp32 master weights + Adam moments lives and steps on the CPU; needs the distributed
  optimizer), ``--no-rope-fusion`` (the TE spec on a GPU uses TE's fused RoPE kernel unless
  given, as Megatron-LM);
* run flags, rewritten to ``--qrl-*`` flags (:func:`qrl_equivalents`; a ``--qrl-*`` flag
  that says something else is one error naming both): ``--lr`` -> ``--qrl-lr``, ``--seed``
  -> ``--qrl-seed``, ``--micro-batch-size`` -> ``--qrl-micro-batch-size``, ``--load DIR`` ->
  ``--qrl-model checkpoint --qrl-checkpoint DIR``, ``--save DIR`` -> ``--qrl-output-dir``,
  ``--save-interval`` -> ``--qrl-save-interval``, ``--train-iters`` -> ``--qrl-steps``,
  ``--global-batch-size`` -> ``--qrl-prompts-per-step`` (global batch = samples per
  optimizer step = prompts * n / updates per step), ``--min-lr`` must equal ``--lr`` (the RL
  learning rate is constant);
* model shape (``--num-layers`` ... ``--moe-aux-loss-coeff``): must agree with the
  checkpoint's config.json; on the built-in tiny models they override its shape
  (:meth:`MegatronSettings.apply_to_hf_config`). Boolean/enum shape flags are checked only
  when given (absent ones are not read as "off": the model's config.json decides);
* ``--seq-length``: the longest prompt + response a batch may hold (longer batches raise);
* ``--bf16``: BF16 parameters and gradients with fp32 master weights and Adam state (megatron's
  mixed-precision optimizer), gradients reduced in fp32; ``--fp16``: refused (no loss scaler);
* ``--tensorboard-dir``: rank 0 also writes the metrics as TensorBoard scalars there;
* ``--moe-token-dispatcher-type`` / ``--moe-grouped-gemm`` / ``--moe-permute-fusion`` /
  ``--moe-router-fusion`` / ``--recompute-modules``: passed to the TransformerConfig (grouped
  GEMM, alltoall and the fusions need TE on a GPU; a forward that replays routing runs the
  unfused top-k, ``moe.ReplayTopKRouter``). ``--qrl-train-moe-fast-path`` sets the fast
  expert path where the flags leave it open (:mod:`megatron_qrl.config.moe_path`).

Vocabulary: Megatron-LM pads the vocabulary to a multiple of ``--make-vocab-size-divisible-by``
x TP; megatron_qrl keeps the checkpoint's ``vocab_size`` (it must be divisible by TP), so the
flag is accepted only when padding to it changes nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..utils.argparse_negative import allow_negative_numbers
from .args import QrlArgumentError
from .generator import finite_float

__all__ = ["FLAGS", "MegatronSettings", "check_shape", "flag_for_hf_key", "megatron_parser",
           "parse_megatron_flags", "qrl_equivalents"]

_T, _F = "store_true", "store_false"
# (flag, dest, type or action, default, choices): Megatron-LM's names, dests and defaults.
FLAGS: tuple[tuple[str, str, Any, Any, tuple | None], ...] = (
    ("--tensor-model-parallel-size", "tensor_model_parallel_size", int, 1, None),
    ("--pipeline-model-parallel-size", "pipeline_model_parallel_size", int, 1, None),
    ("--num-layers-per-virtual-pipeline-stage", "num_layers_per_virtual_pipeline_stage", int,
     None, None),
    ("--num-virtual-stages-per-pipeline-rank", "num_virtual_stages_per_pipeline_rank", int,
     None, None),
    ("--expert-model-parallel-size", "expert_model_parallel_size", int, 1, None),
    ("--expert-tensor-parallel-size", "expert_tensor_parallel_size", int, None, None),
    ("--sequence-parallel", "sequence_parallel", _T, False, None),
    ("--use-distributed-optimizer", "use_distributed_optimizer", _T, False, None),
    ("--optimizer-cpu-offload", "optimizer_cpu_offload", _T, False, None),
    ("--optimizer-offload-fraction", "optimizer_offload_fraction", float, 1.0, None),
    ("--transformer-impl", "transformer_impl", str, "transformer_engine",
     ("local", "transformer_engine")),
    ("--no-rope-fusion", "apply_rope_fusion", _F, True, None),
    ("--recompute-granularity", "recompute_granularity", str, None, ("full", "selective")),
    ("--recompute-method", "recompute_method", str, None, ("uniform", "block")),
    ("--recompute-num-layers", "recompute_num_layers", int, None, None),
    ("--recompute-modules", "recompute_modules", "list", None, None),
    ("--micro-batch-size", "micro_batch_size", int, None, None),
    ("--global-batch-size", "global_batch_size", int, None, None),
    ("--lr", "lr", float, None, None),
    ("--min-lr", "min_lr", float, 0.0, None),
    ("--seed", "seed", int, 1234, None),
    ("--bf16", "bf16", _T, False, None),
    ("--fp16", "fp16", _T, False, None),
    ("--num-layers", "num_layers", int, None, None),
    ("--hidden-size", "hidden_size", int, None, None),
    ("--ffn-hidden-size", "ffn_hidden_size", int, None, None),
    ("--num-attention-heads", "num_attention_heads", int, None, None),
    ("--group-query-attention", "group_query_attention", _T, False, None),
    ("--num-query-groups", "num_query_groups", int, 1, None),
    ("--kv-channels", "kv_channels", int, None, None),
    ("--qk-layernorm", "qk_layernorm", _T, False, None),
    ("--normalization", "normalization", str, "LayerNorm", ("LayerNorm", "RMSNorm")),
    ("--norm-epsilon", "norm_epsilon", float, 1e-5, None),
    ("--swiglu", "swiglu", _T, False, None),
    ("--position-embedding-type", "position_embedding_type", str, "learned_absolute",
     ("learned_absolute", "rope", "mrope", "relative", "none")),
    ("--rotary-base", "rotary_base", int, 10000, None),
    ("--max-position-embeddings", "max_position_embeddings", int, None, None),
    ("--seq-length", "seq_length", int, None, None),
    ("--untie-embeddings-and-output-weights", "untie_embeddings_and_output_weights", _T,
     False, None),
    ("--disable-bias-linear", "add_bias_linear", _F, True, None),
    ("--vocab-size", "vocab_size", int, None, None),
    ("--make-vocab-size-divisible-by", "make_vocab_size_divisible_by", int, 128, None),
    ("--num-experts", "num_experts", int, None, None),
    ("--moe-router-topk", "moe_router_topk", int, 2, None),
    ("--moe-ffn-hidden-size", "moe_ffn_hidden_size", int, None, None),
    ("--moe-router-load-balancing-type", "moe_router_load_balancing_type", str, "aux_loss",
     ("aux_loss", "seq_aux_loss", "sinkhorn", "none")),
    ("--moe-aux-loss-coeff", "moe_aux_loss_coeff", float, 0.0, None),
    ("--moe-router-dtype", "moe_router_dtype", str, None, ("fp32", "fp64")),
    ("--moe-token-dispatcher-type", "moe_token_dispatcher_type", str, "allgather",
     ("allgather", "alltoall", "flex")),
    ("--moe-grouped-gemm", "moe_grouped_gemm", _T, False, None),
    ("--moe-permute-fusion", "moe_permute_fusion", _T, False, None),
    ("--moe-router-fusion", "moe_router_fusion", _T, False, None),
    ("--load", "load", str, None, None),
    ("--save", "save", str, None, None),
    ("--save-interval", "save_interval", int, None, None),
    ("--train-iters", "train_iters", int, None, None),
    ("--tensorboard-dir", "tensorboard_dir", str, None, None),
)
SUPPORTED = tuple(f[0] for f in FLAGS)
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mlp", "moe")
"""``--recompute-modules`` choices of megatron-core 0.16.1 that a Qwen3(-MoE) model has."""
_FLAG_OF = {f[1]: f[0] for f in FLAGS}

# Model-shape flags with a value: (dest, ModelArch field, HF config.json key; None: no key).
SHAPE: tuple[tuple[str, str, str | None], ...] = (
    ("num_layers", "num_layers", "num_hidden_layers"),
    ("hidden_size", "hidden_size", "hidden_size"),
    ("ffn_hidden_size", "ffn_hidden_size", "intermediate_size"),
    ("num_attention_heads", "num_heads", "num_attention_heads"),
    ("num_query_groups", "num_kv_heads", "num_key_value_heads"),
    ("kv_channels", "head_dim", "head_dim"),
    ("norm_epsilon", "rms_norm_eps", "rms_norm_eps"),
    ("rotary_base", "rope_theta", "rope_theta"),
    ("max_position_embeddings", "max_position_embeddings", "max_position_embeddings"),
    ("vocab_size", "vocab_size", None),
    ("num_experts", "num_experts", "num_experts"),
    ("moe_router_topk", "moe_top_k", "num_experts_per_tok"),
    ("moe_ffn_hidden_size", "moe_ffn_hidden_size", "moe_intermediate_size"),
    ("moe_aux_loss_coeff", "router_aux_loss_coef", "router_aux_loss_coef"),
)
_MOE_ONLY = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_aux_loss_coeff",
             "moe_router_load_balancing_type", "moe_router_dtype", "moe_token_dispatcher_type",
             "moe_grouped_gemm", "moe_permute_fusion", "moe_router_fusion")
# Enum / boolean shape flags: (dest, the only value megatron_qrl's Qwen3 builder matches).
FIXED = (("normalization", "RMSNorm"), ("position_embedding_type", "rope"),
         ("qk_layernorm", True), ("swiglu", True), ("add_bias_linear", False),
         ("group_query_attention", True), ("moe_router_load_balancing_type", "aux_loss"),
         ("moe_router_dtype", "fp32"))


def megatron_parser() -> tuple[argparse.ArgumentParser, bool]:
    """``(parser, upstream)``: Megatron-LM's own parser when ``megatron.training`` is
    importable (``upstream`` True), else one built from :data:`FLAGS`."""
    if importlib.util.find_spec("megatron.training") is not None and \
            importlib.util.find_spec("megatron.training.arguments") is not None:
        from megatron.training.arguments import add_megatron_arguments  # pragma: no cover

        return add_megatron_arguments(allow_negative_numbers(  # pragma: no cover
            argparse.ArgumentParser(prog="qrl-train -- (Megatron flags)",
                                    allow_abbrev=False))), True
    parser = allow_negative_numbers(argparse.ArgumentParser(
        prog="qrl-train -- (Megatron flags)", allow_abbrev=False, add_help=False))
    for flag, dest, kind, default, choices in FLAGS:
        if kind in (_T, _F):
            parser.add_argument(flag, dest=dest, action=kind, default=default)
        elif kind == "list":
            parser.add_argument(flag, dest=dest, nargs="*", type=str, default=default)
        else:
            parser.add_argument(flag, dest=dest, type=finite_float if kind is float else kind,
                                default=default, choices=choices)
    return parser, False


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, frozenset[str], bool]:
    """``(namespace, dests the command line set, upstream parser?)``; unknown flags raise."""
    parser, upstream = megatron_parser()
    ns, unknown = parser.parse_known_args(list(argv))
    if unknown:
        raise QrlArgumentError(
            f"Megatron flags after '--': {' '.join(unknown)} not supported by qrl-train; the "
            f"supported Megatron flags are: {' '.join(SUPPORTED)}")
    probe, _ = megatron_parser()
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    explicit = frozenset(vars(probe.parse_known_args(list(argv))[0]))
    for dest in sorted(explicit):  # the upstream parser's float flags take nan / inf
        value = getattr(ns, dest, None)
        if isinstance(value, float) and not math.isfinite(value):
            raise QrlArgumentError(f"{_FLAG_OF.get(dest, dest)} {value}: not a finite number")
    unused = sorted(d for d in explicit if d not in _FLAG_OF)  # upstream parser: more flags
    if unused:
        raise QrlArgumentError(
            f"Megatron flags after '--': {', '.join(unused)} (Megatron-LM dests) have no effect "
            f"in qrl-train; drop them. Supported: {' '.join(SUPPORTED)}")
    return ns, explicit, upstream


@dataclass(frozen=True)
class MegatronSettings:
    """What the Megatron flags after ``--`` ask of the run (besides the ``--qrl-*`` rewrites)."""

    tp: int = 1
    """--tensor-model-parallel-size."""
    ep: int = 1
    """--expert-model-parallel-size."""
    etp: int = 1
    """--expert-tensor-parallel-size (Megatron: defaults to TP)."""
    pp: int = 1
    """--pipeline-model-parallel-size."""
    sequence_parallel: bool = False
    """--sequence-parallel."""
    bf16: bool = False
    """--bf16: BF16 parameters, fp32 master weights in the optimizer."""
    seq_length: int | None = None
    """--seq-length: longest prompt + response a batch may hold (None: no limit)."""
    shape: tuple[tuple[str, Any], ...] = ()
    """Explicit model-shape flags ``(dest, value)`` (checked / applied on the model)."""
    config_overrides: tuple[tuple[str, Any], ...] = ()
    """TransformerConfig overrides (token dispatcher, grouped GEMM, activation recompute)."""
    transformer_impl: str = "auto"
    """--transformer-impl (``auto`` when absent: TE where it imports and a GPU is present)."""
    distributed_optimizer: bool = False
    """--use-distributed-optimizer."""
    optimizer_cpu_offload: bool = False
    """--optimizer-cpu-offload."""
    optimizer_offload_fraction: float = 1.0
    """--optimizer-offload-fraction (share of the optimizer state on the CPU)."""
    argv: tuple[str, ...] = field(default=())
    """The Megatron flags as given."""

    @property
    def model_parallel_size(self) -> int:
        """Processes one model replica spans (max(TP, EP x ETP) x PP bounds the world size)."""
        return max(self.tp, self.ep * self.etp) * self.pp

    def layout(self) -> Any:
        """The :class:`megatron_qrl.models.builder.ParallelLayout` of these flags."""
        from megatron_qrl.models.builder import ParallelLayout

        return ParallelLayout(tp=self.tp, ep=self.ep, etp=self.etp,
                              sequence_parallel=self.sequence_parallel, pp=self.pp)

    def describe(self) -> str:
        """The layout as stored with checkpoints (a resume must use the same one)."""
        text = f"tp={self.tp},ep={self.ep},etp={self.etp},sp={int(self.sequence_parallel)}"
        text += f",pp={self.pp}" if self.pp > 1 else ""
        return text + (",bf16" if self.bf16 else "") + (",distopt" if self.distributed_optimizer
                                                        else "")

    def check_world(self, world_size: int) -> None:
        """Raise naming the flags when ``world_size`` processes cannot hold the layout."""
        dense, expert = self.tp * self.pp, self.ep * self.etp * self.pp
        if world_size % dense or world_size % expert:
            pp = f"--pipeline-model-parallel-size {self.pp} " if self.pp > 1 else ""
            raise QrlArgumentError(
                f"--tensor-model-parallel-size {self.tp} {pp}--expert-model-parallel-size "
                f"{self.ep} --expert-tensor-parallel-size {self.etp} need a number of processes "
                f"divisible by {dense} and by {expert}; this job has {world_size}: launch "
                f"with torchrun --nproc-per-node {self.model_parallel_size} -m "
                "megatron_qrl.rl.cli ...")

    def apply_to_hf_config(self, cfg: dict, arch: Any, source: str, fixed_model: bool) -> dict:
        """``cfg`` with the shape flags applied (tiny model) or checked (``fixed_model``).

        Raises :class:`QrlArgumentError` naming the flag and ``source`` when a flag disagrees
        with a checkpoint's model, or names a MoE option on a dense model.
        """
        out = dict(cfg)
        for dest, value in self.shape:
            if dest in _MOE_ONLY and not arch.is_moe:
                raise QrlArgumentError(f"{_FLAG_OF[dest]} is a MoE flag but {source} is dense "
                                       f"({arch.architecture}); drop it (or use --qrl-model "
                                       "tiny-moe)")
            if dest == "make_vocab_size_divisible_by" and arch.vocab_size % value:
                raise QrlArgumentError(
                    f"--make-vocab-size-divisible-by {value}: {source} has vocab_size "
                    f"{arch.vocab_size}, which Megatron-LM would pad; megatron_qrl keeps the "
                    "checkpoint's vocabulary, so give a divisor of it (or drop the flag)")
            if dest == "untie_embeddings_and_output_weights" and arch.tie_word_embeddings:
                if fixed_model:
                    raise QrlArgumentError(
                        f"--untie-embeddings-and-output-weights: {source} ties its output layer "
                        "to the embedding (tie_word_embeddings true); drop the flag")
                out["tie_word_embeddings"] = False
            row = next((r for r in SHAPE if r[0] == dest), None)
            if row is None:
                continue
            have = getattr(arch, row[1])
            if _same(have, value):
                continue
            if fixed_model or row[2] is None:
                what = "the tokenizer's vocabulary" if row[2] is None and not fixed_model \
                    else "its config.json"
                raise QrlArgumentError(
                    f"{_FLAG_OF[dest]} {value} disagrees with {source} ({row[1]} = {have} in "
                    f"{what}); drop {_FLAG_OF[dest]} or give the model's value")
            out[row[2]] = value
        return out


def flag_for_hf_key(key: str) -> str | None:
    """The Megatron flag that sets the HF config.json field ``key`` (None: no flag does)."""
    if key == "tie_word_embeddings":
        return "--untie-embeddings-and-output-weights"
    return next((_FLAG_OF[d] for d, _, k in SHAPE if k == key), None)


def check_shape(settings: MegatronSettings, cfg: dict, source: str) -> Any:
    """``cfg``'s ``ModelArch``; a config the shape flags made unsupported is one error
    naming the flags (not the config.json field they set)."""
    from megatron_qrl.models.hf_config import UnsupportedModelError, arch_from_dict

    try:
        return arch_from_dict(cfg, source=source)
    except UnsupportedModelError as exc:
        text = str(exc).replace("config.json: ", "")
        given = [(d, v, row[2]) for d, v in settings.shape for row in SHAPE if row[0] == d]
        named = [g for g in given if g[2] in exc.fields] or given
        if not named:
            raise
        flags = " ".join(f"{_FLAG_OF[d]} {v}" for d, v, *_ in named)
        raise QrlArgumentError(f"{flags} (after '--'): {source} with this shape is not "
                               f"supported: {text}; give other values") from None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(a)))
    return a == b


def _refuse(ns: argparse.Namespace, explicit: frozenset[str]) -> None:
    """Flags this build cannot honour: one error each, naming what would make it work."""
    virtual = [f"{_FLAG_OF[d]} {getattr(ns, d)}" for d in (
        "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank")
        if getattr(ns, d) is not None]
    if virtual:
        raise QrlArgumentError(
            f"{virtual[0]}: qrl-train runs megatron-core's non-interleaved 1F1B pipeline "
            "schedule, one model chunk per pipeline rank: the interleaved schedule of "
            "megatron-core 0.16.1 takes V chunks per rank (each its own non-contiguous layers "
            "and data iterator), and the trainer's weight sync, LoRA, routing replay and "
            "checkpoints address one contiguous stage per rank; drop the flag "
            "(--pipeline-model-parallel-size alone)")
    _refuse_memory_flags(ns, explicit)
    if ns.fp16:
        raise QrlArgumentError(
            "--fp16: qrl-train's trainer runs fp32 or --bf16 (fp32 master weights); fp16 needs "
            "a loss scaler that is not wired; use --bf16 (the rollout engine's precision is "
            "--qrl-rollout-format)")
    if ns.bf16 and ns.fp16:  # pragma: no cover (fp16 raised above)
        raise QrlArgumentError("--bf16 and --fp16 exclude each other")
    if ns.moe_token_dispatcher_type == "flex":
        raise QrlArgumentError("--moe-token-dispatcher-type flex needs DeepEP, which qrl-train "
                               "does not wire; use alltoall (GPU) or allgather")
    needs_te = [f for f, on in (("--moe-grouped-gemm", ns.moe_grouped_gemm),
                                ("--moe-permute-fusion", ns.moe_permute_fusion),
                                ("--moe-router-fusion", ns.moe_router_fusion),
                                ("--moe-token-dispatcher-type alltoall",
                                 ns.moe_token_dispatcher_type == "alltoall")) if on]
    if needs_te:
        from megatron_qrl.models.builder import use_transformer_engine

        if not use_transformer_engine():
            raise QrlArgumentError(
                f"{needs_te[0]} needs Transformer Engine on a GPU (megatron-core 0.16.1's "
                "alltoall dispatcher builds a CUDA stream, grouped GEMM and the fused permute "
                "are TE's); without it "
                "drop the flag (qrl-train then uses the allgather dispatcher, same maths)")
    if ns.moe_grouped_gemm and "transformer_impl" in explicit and ns.transformer_impl == "local":
        raise QrlArgumentError("--moe-grouped-gemm uses Transformer Engine's grouped GEMM; "
                               "drop it or --transformer-impl local")
    if "num_query_groups" in explicit and not ns.group_query_attention:
        raise QrlArgumentError("--num-query-groups without --group-query-attention: Megatron "
                               "ignores it then; add --group-query-attention")
    if "min_lr" in explicit and ns.lr is not None and not _same(ns.min_lr, ns.lr):
        raise QrlArgumentError(f"--min-lr {ns.min_lr}: qrl-train's RL learning rate is constant "
                               f"(--lr {ns.lr}); drop --min-lr or set it equal to --lr")
    if "min_lr" in explicit and ns.lr is None:
        raise QrlArgumentError("--min-lr needs --lr (the RL learning rate is constant; they "
                               "must be equal)")
    for dest, want in FIXED:
        if dest in explicit and getattr(ns, dest) != want:
            raise QrlArgumentError(
                f"{_FLAG_OF[dest]} {getattr(ns, dest)}: megatron_qrl builds Qwen3 / Qwen3-MoE "
                f"models, which need {want}; drop the flag")


def _refuse_memory_flags(ns: argparse.Namespace, explicit: frozenset[str]) -> None:
    """Megatron-LM's own checks of the recompute / optimizer-offload flags, as one error each."""
    if ns.optimizer_cpu_offload and not ns.use_distributed_optimizer:
        raise QrlArgumentError("--optimizer-cpu-offload needs --use-distributed-optimizer "
                               "(megatron-core offloads the distributed optimizer's state)")
    if ns.optimizer_cpu_offload:
        import torch

        if not torch.cuda.is_available():
            raise QrlArgumentError("--optimizer-cpu-offload moves the optimizer state from the "
                                   "GPU to the CPU (megatron-core's HybridDeviceOptimizer needs "
                                   "CUDA); on a CPU-only host drop it")
    if "optimizer_offload_fraction" in explicit and not ns.optimizer_cpu_offload:
        raise QrlArgumentError("--optimizer-offload-fraction without --optimizer-cpu-offload "
                               "has no effect; add --optimizer-cpu-offload or drop it")
    if not 0.0 <= ns.optimizer_offload_fraction <= 1.0:
        raise QrlArgumentError(f"--optimizer-offload-fraction {ns.optimizer_offload_fraction} "
                               "must be in [0, 1]")
    gran, method, layers = ns.recompute_granularity, ns.recompute_method, ns.recompute_num_layers
    if gran is None and (method is not None or layers is not None):
        raise QrlArgumentError("--recompute-method / --recompute-num-layers need "
                               "--recompute-granularity full")
    if gran == "full" and (method is None or layers is None):
        raise QrlArgumentError("--recompute-granularity full needs --recompute-method "
                               "uniform|block and --recompute-num-layers N (e.g. uniform 1: "
                               "every layer's input kept, the layer recomputed in backward)")
    if gran == "selective" and (method is not None or layers is not None):
        raise QrlArgumentError("--recompute-granularity selective takes no --recompute-method / "
                               "--recompute-num-layers (Megatron recomputes the "
                               "--recompute-modules, default core_attn)")
    modules = ns.recompute_modules
    if modules is not None and gran != "selective":
        raise QrlArgumentError("--recompute-modules needs --recompute-granularity selective")
    bad = sorted(set(modules or ()) - set(RECOMPUTE_MODULES))
    if bad or modules == []:
        raise QrlArgumentError(f"--recompute-modules {' '.join(modules)}: choose from "
                               f"{' '.join(RECOMPUTE_MODULES)} (megatron-core 0.16.1)")
    if layers is not None and layers < 1:
        raise QrlArgumentError(f"--recompute-num-layers must be >= 1, got {layers}")
    if "transformer_impl" in explicit and ns.transformer_impl == "transformer_engine":
        from megatron_qrl.models.builder import use_transformer_engine

        if not use_transformer_engine():
            raise QrlArgumentError("--transformer-impl transformer_engine: Transformer Engine "
                                   "does not import here; install it or use --transformer-impl "
                                   "local (SDPA attention)")


def qrl_equivalents(ns: argparse.Namespace, explicit: frozenset[str]
                    ) -> list[tuple[str, str, Any]]:
    """``(megatron flag, --qrl-* flag, value)`` rewrites of the given run flags.

    ``--load DIR`` gives two (``--qrl-model checkpoint``, ``--qrl-checkpoint DIR``);
    ``--global-batch-size`` is resolved by the caller (it needs ``n`` and updates per step).
    """
    pairs = (("lr", "--qrl-lr"), ("seed", "--qrl-seed"),
             ("micro_batch_size", "--qrl-micro-batch-size"), ("save", "--qrl-output-dir"),
             ("save_interval", "--qrl-save-interval"), ("train_iters", "--qrl-steps"),
             ("tensorboard_dir", "--qrl-tensorboard-dir"))
    out = [(_FLAG_OF[d], q, getattr(ns, d)) for d, q in pairs if d in explicit]
    if "load" in explicit:
        out += [("--load", "--qrl-model", "checkpoint"), ("--load", "--qrl-checkpoint", ns.load)]
    return out


def parse_megatron_flags(argv: Sequence[str]
                         ) -> tuple[MegatronSettings, list[tuple[str, str, Any]], int | None]:
    """``(settings, --qrl-* rewrites, --global-batch-size or None)`` of the flags after ``--``.

    Raises :class:`QrlArgumentError` naming the flag for unknown flags and for flags this
    build cannot honour.
    """
    ns, explicit, _ = _parse(argv)
    _refuse(ns, explicit)
    for dest in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "expert_model_parallel_size",
                 "expert_tensor_parallel_size", "micro_batch_size", "global_batch_size",
                 "seq_length", "save_interval", "train_iters", "num_layers", "hidden_size",
                 "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                 "max_position_embeddings", "vocab_size", "num_experts", "moe_router_topk",
                 "moe_ffn_hidden_size", "make_vocab_size_divisible_by"):
        value = getattr(ns, dest)
        if dest in explicit and value is not None and value < (0 if dest in (
                "save_interval", "train_iters") else 1):
            raise QrlArgumentError(f"{_FLAG_OF[dest]} must be >= 1, got {value}")
    tp = ns.tensor_model_parallel_size
    etp = tp if ns.expert_tensor_parallel_size is None else ns.expert_tensor_parallel_size
    shape = tuple((d, getattr(ns, d)) for d, *_ in SHAPE if d in explicit)
    shape += tuple((d, getattr(ns, d)) for d in ("moe_router_load_balancing_type",
                                                  "moe_router_dtype") if d in explicit)
    overrides: list[tuple[str, Any]] = []
    if "moe_token_dispatcher_type" in explicit:
        overrides.append(("moe_token_dispatcher_type", ns.moe_token_dispatcher_type))
    for dest in ("recompute_granularity", "recompute_method", "recompute_num_layers"):
        if getattr(ns, dest) is not None:
            overrides.append((dest, getattr(ns, dest)))
    if ns.recompute_modules is not None:
        overrides.append(("recompute_modules", tuple(ns.recompute_modules)))
    if "apply_rope_fusion" in explicit:  # --no-rope-fusion; absent: the builder decides
        overrides.append(("apply_rope_fusion", False))
    if ns.moe_grouped_gemm:
        overrides.append(("moe_grouped_gemm", True))
        shape += (("moe_grouped_gemm", True),)
    for dest in ("moe_permute_fusion", "moe_router_fusion"):
        if getattr(ns, dest):
            overrides.append((dest, True))
            shape += ((dest, True),)
    if ns.untie_embeddings_and_output_weights:
        shape += (("untie_embeddings_and_output_weights", True),)
    if "make_vocab_size_divisible_by" in explicit:
        shape += (("make_vocab_size_divisible_by", ns.make_vocab_size_divisible_by),)
    settings = MegatronSettings(
        tp=tp, ep=ns.expert_model_parallel_size, etp=etp, pp=ns.pipeline_model_parallel_size,
        sequence_parallel=bool(ns.sequence_parallel), bf16=bool(ns.bf16),
        seq_length=ns.seq_length,
        shape=shape, config_overrides=tuple(overrides),
        transformer_impl=ns.transformer_impl if "transformer_impl" in explicit else "auto",
        distributed_optimizer=bool(ns.use_distributed_optimizer),
        optimizer_cpu_offload=bool(ns.optimizer_cpu_offload),
        optimizer_offload_fraction=float(ns.optimizer_offload_fraction),
        argv=tuple(argv))
    return settings, qrl_equivalents(ns, explicit), ns.global_batch_size
