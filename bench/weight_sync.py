#!/usr/bin/env python3
"""Weight sync time trainer -> SGLang for a Qwen3-30B-A3B-shaped model (``--model qwen3_4b``:
the dense Qwen3-4B of the 1-GPU example), per format.

    python bench/weight_sync.py --variants bf16:tensor,fp8_block:disk,int8:inplace \
        --out bench/results/weight_sync.jsonl

Colocated setting: the engine (``load_format="dummy"``, one H200) and the trainer's BF16
weights share the GPU. The trainer side is a stream of HF-named BF16 tensors on the GPU
(one layer's worth of random tensors, renamed for each of the 48 layers, so the trainer's
copy costs 1.2 GB instead of 57 GB). Measured per variant, in one process:
- ``pack_s``: ``QuantSpec.pack_state_dict`` over the whole stream, output discarded
  (``--pack-compare`` adds ``pack_one_s``, the one-at-a-time reference ``stacked=False``, and
  ``pack_speedup``; ``--pack-only`` stops there, no engine);
- ``sync_s``: ``SGLangEngine.update_weights`` (pack + send in buckets + engine load +
  weight_version check), the number the RL step pays;
then one short greedy generate proves the engine still runs. Variant ``FMT:distributed``
(2 GPUs) puts the engine on GPU 1 and broadcasts every bucket from the trainer's GPU 0 over
NCCL (the disaggregated layout on one node); on one GPU it runs over gloo on the same GPU
(the protocol, not the speed NCCL would give). ``FMT:inplace+flat`` sends each in-place
bucket as one flattened buffer (one CUDA-IPC handle per bucket instead of one per tensor);
``+prefetch`` prepares the next bucket in a thread while the engine loads one
(``SGLangOptions(prefetch_buckets=1)``); ``+direct`` loads expert tensors straight into their
FusedMoE parameters (``direct_expert_loads``); ``+stacked`` (with ``+direct``) sends each layer's
experts of one kind as one stacked tensor (``stack_experts``); ``+noreceipt`` skips the
engine's receipt (its fingerprints of what it received, compared with what was sent: on by
default, ``SGLangOptions.receipt``); options combine:
``fp8:inplace+flat+prefetch+direct+stacked`` is the engine's default in place. A variant runs
exactly the options it names. ``fp8:direct`` / ``fp8_block:direct`` / ``int8:direct`` is the
direct sync (``SGLangOptions(sync="direct")``: the trainer's BF16 weights quantized straight
into the engine's own tensors through CUDA IPC handles, ``QuantSpec.quantize_into``, one
read-back digest; its parts ``storage`` (fingerprint / handles), ``write`` and ``digest``,
and the weights ``quantized`` / tensors ``copied``); ``+packed`` hands it the packed stream
instead, copied into its tensors (the direct sync before it quantized in place), side by
side; ``+qcache`` (any engine variant) sends codes and scales quantized before the clock, as
the aligned forward's Q(W) cache holds them (copied, not quantized, by ``direct``);
``+params`` streams the trainer's weights as a trainer holds them (every layer its own
tensors, made before the clock, the same every sync; three syncs, ``_v3`` the third) and
``+nohold`` turns off ``SGLangOptions.hold_trainer_tensors`` (the engine-side write's held
parameters, sent by name from the third sync on: ``held_refs``).
``+resident`` starts any engine without its memory saver (``release_memory=False``); with
the saver (the default) the engine's memory is released and resumed before each sync, outside
the clock, as the RL loop does (``released_before_sync``), and ``direct`` is written by the
engine from the trainer's tensors (the saver's memory cannot be handed out by CUDA IPC:
``engine_writes``), ``direct+resident`` by the trainer into the engine's tensors.

``--produce-only`` times just the trainer's side of the in-place sync, no engine and no SGLang
(pure torch: pack, fingerprints, expert stacking, flat buckets, as the engine's sender:
``megatron_qrl.rollout_sglang.sync.sender.requests``),
and checks that every variant leaves the same fingerprints; option ``fpeach`` fingerprints
each expert before stacking (the older order) to time the rows of
``checksum_rows`` side by side. With ``+stacked`` the experts leave the pack stream stacked
(``pack_state_dict(stack_experts=True)``, no per-expert copies, the default);
``+packeach`` packs them per expert and stacks them in the sender (the path before; ``fpeach``
implies it), for the engine variants too. ``+qcache`` (here as in the engine variants) packs
codes and scales quantized before the clock starts, as the trainer's aligned-forward Q(W)
cache holds them (``pack_state_dict(quantized=...)``, :mod:`megatron_qrl.rl.qcache_sync`):
the sync without its quantization, same fingerprints. ``--device cpu --layers 1 --experts 8``
is a CPU smoke run. What the direct sync does per weight, counted on the CPU:
bench/sync_census.py. The trainer's experts are rows of one ``[E, out, in]`` tensor per kind
(as a stacked-experts trainer holds them), so stacking them again is a view.

``--profile PATH`` traces each engine variant's last sync (the second; the third with
``+params``, when the engine holds the parameters) with ``torch.profiler``
(megatron_qrl/utils/profile.py): the record gets ``profile`` — wall vs GPU busy seconds of the trainer's
process, the top kernels and host ops, the host syncs seen, and ``ranges_ms`` with the direct
sync's write step (``qrl.direct.write``, what ``write_s`` times: producing the stream,
quantizing / copying, fingerprints) — and the Chrome trace goes to ``PATH`` with the
variant's name appended.

Print a saved run with ``--table FILE.jsonl``; ``--plot FILE.png`` draws where each variant's
second sync went (after a run, or with ``--table``):

    python bench/weight_sync.py --table bench/results/weight_sync_run10_stacked_default.jsonl \
        --plot docs/weight_sync_run10.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._runner import child_main, run_variant  # noqa: E402
from megatron_qrl.utils.profile import Traced  # noqa: E402

CONFIGS = ROOT / "megatron_qrl" / "data" / "configs"
MODELS = ("qwen3_30b_a3b", "qwen3_4b")
"""``--model``: the shapes the sync is timed at (configs in megatron_qrl/data/configs)."""


def layer_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor names (without the ``model.layers.{i}.`` prefix) -> shape of one layer."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    out = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
           "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
           "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
           "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
    if "num_experts" not in cfg:  # dense
        f = cfg["intermediate_size"]
        return out | {"mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h),
                      "mlp.down_proj.weight": (h, f)}
    e, f = cfg["num_experts"], cfg["moe_intermediate_size"]
    out["mlp.gate.weight"] = (e, h)
    for j in range(e):
        out |= {f"mlp.experts.{j}.gate_proj.weight": (f, h), f"mlp.experts.{j}.up_proj.weight": (f, h),
                f"mlp.experts.{j}.down_proj.weight": (h, f)}
    return out


def trainer_stream(cfg: dict, device: str = "cuda",
                   distinct: bool = False) -> Iterator[tuple[str, Any]]:
    """Every HF tensor of the model, BF16 on ``device`` (one layer's random values reused;
    ``distinct``: each layer its own, as a trainer's parameters are; each expert projection a
    row of one ``[E, out, in]`` tensor, as a stacked-experts trainer streams them)."""
    import torch

    g = torch.Generator(device=device).manual_seed(0)

    def rand(shape):
        return (torch.randn(shape, generator=g, device=device) * (0.02 if len(shape) > 1 else 1.0)
                + (0 if len(shape) > 1 else 1.0)).bfloat16()

    shapes = layer_shapes(cfg)

    def new_layer() -> dict[str, Any]:
        stacks = {proj: rand((cfg["num_experts"], *shapes[f"mlp.experts.0.{proj}.weight"]))
                  for proj in ("gate_proj", "up_proj", "down_proj")} if "num_experts" in cfg else {}
        return {k: stacks[k.split(".")[3]][int(k.split(".")[2])] if k.startswith("mlp.experts.")
                else rand(s) for k, s in shapes.items()}

    layer = new_layer()
    v, h = cfg["vocab_size"], cfg["hidden_size"]
    emb = (torch.randn(v, h, generator=g, device=device) * 0.02).bfloat16()
    yield "model.embed_tokens.weight", emb
    for i in range(cfg["num_hidden_layers"]):
        if distinct and i:
            layer = new_layer()
        for k, t in layer.items():
            yield f"model.layers.{i}.{k}", t
    yield "model.norm.weight", torch.ones(h, device=device, dtype=torch.bfloat16)
    if not cfg.get("tie_word_embeddings", False):
        yield "lm_head.weight", emb


def _synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_pack(spec, cfg: dict, stacked: bool = True, device: str = "cuda") -> tuple[float, int]:
    """Seconds and packed bytes of ``spec.pack_state_dict`` over the whole stream."""
    _synchronize(device)
    t = time.perf_counter()
    nbytes = 0
    for _, p in spec.pack_state_dict(trainer_stream(cfg, device), stacked=stacked):
        nbytes += p.numel() * p.element_size()
    _synchronize(device)
    return time.perf_counter() - t, nbytes


def model_config(layers: int | None = None, experts: int | None = None,
                 model: str = "qwen3_30b_a3b") -> dict:
    """``model``'s config (the 30B-A3B by default), optionally cut to ``layers`` decoder
    layers / ``experts`` experts (``--layers`` / ``--experts``: a CPU smoke run or a quick look
    at one layer's costs)."""
    if model not in MODELS:
        raise ValueError(f"--model {model!r}: one of {', '.join(MODELS)}")
    cfg = json.loads((CONFIGS / f"{model}.json").read_text())
    if experts is not None and "num_experts" not in cfg:
        raise ValueError(f"--experts: --model {model} is dense")
    for key, value in (("num_hidden_layers", layers), ("num_experts", experts)):
        if value is not None:
            if value < 1:
                raise ValueError(f"--{key.split('_')[-1]} must be >= 1, got {value}")
            cfg[key] = value
    if "num_experts" in cfg:
        cfg["num_experts_per_tok"] = min(cfg["num_experts_per_tok"], cfg["num_experts"])
    return cfg


def produce(spec, cfg: dict, opts: list[str], bucket_mb: int, device: str) -> dict:
    """The trainer's side of an in-place sync without an engine (``--produce-only``): packing,
    fingerprints, expert stacking and flat buckets exactly as the engine's sender
    (:func:`megatron_qrl.rollout_sglang.sync.sender.requests`) does them, every bucket consumed and dropped; two syncs, as the engine variants time them.
    ``fpeach``: fingerprint each expert before stacking (the older order)."""
    import hashlib

    import torch

    from megatron_qrl.rollout.base import Checksums
    from megatron_qrl.rollout_sglang import SGLangOptions
    from megatron_qrl.rollout_sglang.sync.sender import StreamTracker, packed_suffixes, requests

    quantized = _qcache(spec, cfg, device) if "qcache" in opts else None
    o = SGLangOptions(sync="inplace", flat_buckets="flat" in opts, prefetch_buckets=0,
                      direct_expert_loads="direct" in opts,
                      stack_experts="stacked" in opts).resolve(spec.name)
    res: dict = {}
    for version in (1, 2):
        sent, lap = Checksums(), {}
        tracker = StreamTracker(packed_suffixes(spec), direct_experts=o.direct_expert_loads)
        _synchronize(device)
        t = time.perf_counter()
        wire = buckets = 0
        packed = spec.pack_state_dict(trainer_stream(cfg, device), stack_experts=o.stack_experts
                                      and not {"fpeach", "packeach"} & set(opts),
                                      quantized=quantized)
        for items, _, _ in requests(packed, sent, tracker, torch.device(device),
                                    bucket_bytes=bucket_mb * 2**20,
                                    flat=o.flat_buckets, stack=o.stack_experts,
                                    rows="fpeach" not in opts, lap=lap):
            buckets += 1
            wire += len(items)
        t1 = time.perf_counter()
        fingerprints = sent.result()  # the engine's finish: one host transfer
        _synchronize(device)
        res[f"produce_s_v{version}"] = round(t1 - t, 2)
        res[f"finish_s_v{version}"] = round(time.perf_counter() - t1, 2)
        for part in ("stream_s", "fingerprint_s", "flatten_s"):
            res[f"{part.removesuffix('_s')}_s_v{version}"] = round(lap.get(part, 0.0), 2)
        res[f"buckets_v{version}"] = buckets
    res["request_items"] = wire
    res["fingerprints"] = len(fingerprints)
    res["fingerprints_sha256"] = hashlib.sha256(
        json.dumps(fingerprints, sort_keys=True).encode()).hexdigest()[:16]
    return res


def _qcache(spec, cfg: dict, device: str):
    """``+qcache``: ``hf_name -> QuantizedWeight`` of the stream's weights, computed now (the
    trainer's Q(W) cache: a fused group's members with their shared amax; the stream repeats
    one layer, so the first layer's codes serve all)."""
    import re

    def key(name: str) -> str:
        return re.sub(r"^model\.layers\.\d+\.", "model.layers.0.", name)

    first = {n: t for n, t in trainer_stream(cfg, device) if key(n) == n}
    one = {n: spec.quantize_weight(t, global_amax=spec.shared_amax(n, first), name=n)
           for n, t in first.items() if spec.is_quantized(n)}
    _synchronize(device)
    return lambda name: one.get(key(name))


OPTIONS = ("flat", "prefetch", "direct", "stacked", "fpeach", "packeach", "noreceipt", "qcache",
           "resident", "packed", "params", "nohold")


def engine_stream(eng, spec, cfg: dict, opts: list[str], quantized=None, source=None):
    """What the driver's sync (:func:`megatron_qrl.rl.sync.sync_weights`) hands engine
    ``eng``: the weights for an engine that quantizes them into its storage (``direct``;
    ``+packed``: the packed stream, copied), else the packed stream (``+packeach``: experts
    packed one by one and stacked in the sender); ``quantized``: the ``+qcache`` codes;
    ``source``: the trainer's tensors (``+params``), else a new :func:`trainer_stream`."""
    from megatron_qrl.quant.pack_stream import writer_stream

    weights = iter(source) if source is not None else trainer_stream(cfg)

    stacked = eng.stacked_experts and "packeach" not in opts
    if eng.quantizes_into and "packed" not in opts:
        return writer_stream(spec, weights, quantized=quantized, stack_experts=stacked)
    return spec.pack_state_dict(weights, stack_experts=stacked, quantized=quantized)


def child(variant: str, bucket_mb: int, pack_compare: bool = False,
          pack_only: bool = False, produce_only: bool = False, device: str = "cuda",
          layers: int | None = None, experts: int | None = None,
          profile: str | None = None, model: str = "qwen3_30b_a3b") -> dict:
    import torch

    from megatron_qrl.quant import get_spec
    from megatron_qrl.rollout_sglang import SGLangEngine, SGLangOptions
    from megatron_qrl.rollout_sglang.launch import write_engine_dir

    fmt, sync = variant.split(":")
    sync, *opts = sync.split("+")  # FMT:inplace+flat+prefetch -> flattened, prefetched buckets
    unknown = set(opts) - set(OPTIONS)
    if unknown:
        raise ValueError(f"variant {variant!r}: unknown options {sorted(unknown)} "
                         f"({', '.join(OPTIONS)})")
    if produce_only and sync != "inplace":
        raise ValueError(f"variant {variant!r}: --produce-only times the in-place sync's "
                         "trainer side; use FMT:inplace+...")
    engine = not (pack_only or produce_only)
    if engine and (device != "cuda" or layers or experts):
        raise ValueError("--device / --layers / --experts apply to --pack-only and "
                         "--produce-only (an engine variant runs the whole model on the GPU)")
    for opt in sorted({"fpeach"} & set(opts) if engine else ()):
        raise ValueError(f"variant {variant!r}: {opt} is a --produce-only option")
    if {"params", "qcache"} <= set(opts):
        raise ValueError(f"variant {variant!r}: +qcache repeats one layer's codes, +params "
                         "gives every layer its own weights; use one of them")
    if "packed" in opts and sync != "direct":
        raise ValueError(f"variant {variant!r}: +packed (the packed stream copied) is an "
                         "option of FMT:direct")
    cfg = model_config(layers, experts, model)
    spec = get_spec(fmt)
    res: dict = {"variant": variant, "model": model}
    seconds, nbytes = time_pack(spec, cfg, device=device)
    res["pack_s"] = round(seconds, 2)
    res["packed_gb"] = round(nbytes / 1e9, 2)
    if pack_compare:
        one, _ = time_pack(spec, cfg, stacked=False, device=device)
        res["pack_one_s"] = round(one, 2)
        res["pack_speedup"] = round(one / seconds, 2)
    if produce_only:
        return res | {"device": device} | produce(spec, cfg, opts, bucket_mb, device)
    if pack_only:
        return res
    d = write_engine_dir(cfg, fmt, root="/tmp")
    kw = {"load_format": "dummy", "mem_fraction_static": 0.55, "random_seed": 0,
          "enable_return_routed_experts": False, "log_level": "warning",
          "bucket_bytes": bucket_mb * 2**20}
    # a variant names every option it uses (the engine's defaults in place are all four:
    # flat + prefetch 1 + direct + stacked): "fp8:inplace" is the plain in-place sync; only
    # the in-place sync takes them all (the options refuse the others elsewhere)
    inplace = sync == "inplace"
    options = SGLangOptions(
        sync=sync, sync_dir="/dev/shm/qrl-sync", prefetch_buckets=int("prefetch" in opts),
        flat_buckets=("flat" in opts) if inplace else None,
        direct_expert_loads=("direct" in opts) if inplace else None,
        stack_experts=("stacked" in opts) if inplace else None,  # refused without +direct
        receipt="noreceipt" not in opts,
        release_memory="resident" not in opts, hold_trainer_tensors="nohold" not in opts)
    if sync == "distributed":
        kw |= ({"base_gpu_id": 1, "trainer_device": "cuda:0"} if torch.cuda.device_count() > 1
               else {"trainer_device": "cuda:0", "group_backend": "gloo"})
        res["group_backend"] = kw.get("group_backend", "nccl")
    t = time.perf_counter()
    eng = SGLangEngine(d, fmt, options, **kw)
    res["startup_s"] = round(time.perf_counter() - t, 1)
    quantized = _qcache(spec, cfg, "cuda") if "qcache" in opts else None
    # +params: the trainer's weights made once, every layer its own, the same tensors every
    # sync (what the engine-side write holds from the third sync on)
    source = list(trainer_stream(cfg, distinct=True)) if "params" in opts else None
    res["released_before_sync"] = options.release_memory
    # the first sync also pays one-time costs (IPC setup, allocations)
    versions = (1, 2, 3) if "params" in opts else (1, 2)
    for version in versions:
        if options.release_memory:  # as the RL loop: released after a rollout, resumed for
            eng.release_memory()    # the sync (outside the clock)
            eng.resume_memory()
        torch.cuda.synchronize()
        traced = Traced("cuda") if profile and version == versions[-1] else nullcontext()
        t = time.perf_counter()
        with traced:
            eng.update_weights(engine_stream(eng, spec, cfg, opts, quantized, source),
                               version=version)
        res[f"sync_s_v{version}"] = round(time.perf_counter() - t, 2)
        if isinstance(traced, Traced):
            res["profile"] = traced.summary() | {"trace": traced.export(
                trace_path(profile, variant))}
        res[f"engine_s_v{version}"] = round(eng.last_sync.get("request_s", 0.0), 2)
        for part in ("produce_s", "stream_s", "fingerprint_s", "flatten_s", "wait_s",
                     "serialize_s", "finish_s", "storage_s", "write_s", "digest_s", "loader_s",
                     *sorted(k for k in eng.last_sync if k.startswith("loader_") and k != "loader_s")):
            if part in eng.last_sync:
                res[f"{part.removesuffix('_s')}_s_v{version}"] = round(eng.last_sync[part], 2)
        res[f"buckets_v{version}"] = eng.last_sync.get("buckets")
        for key in ("handles_taken", "quantized", "copied", "engine_writes", "held_refs"):
            if key in eng.last_sync:
                res[f"{key}_v{version}"] = eng.last_sync[key]
    from megatron_qrl.rollout.base import SamplingParams

    out = eng.generate([[1000 + i for i in range(16)]], SamplingParams(
        max_new_tokens=8, temperature=0.0, top_p=1.0, top_k=-1))
    res["generated_tokens"] = int(out.mask.sum())
    eng.shutdown()
    return res


def trace_path(profile: str, variant: str) -> Path:
    """``--profile PATH``'s Chrome trace of ``variant``: ``PATH`` with the variant's name
    (``fp8:direct+resident`` -> ``trace-fp8-direct-resident.json`` for ``trace.json``)."""
    p = Path(profile)
    tag = "".join(c if c.isalnum() or c in "_." else "-" for c in variant)
    p.parent.mkdir(parents=True, exist_ok=True)
    return p.with_name(f"{p.stem}-{tag}{p.suffix or '.json'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="bf16:tensor,fp8_block:disk")
    p.add_argument("--model", choices=MODELS, default="qwen3_30b_a3b",
                   help="the shapes (default the 30B-A3B; qwen3_4b: the 1-GPU example's)")
    p.add_argument("--bucket-mb", type=int, default=1024)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--pack-compare", action="store_true",
                   help="also time the one-at-a-time pack (stacked=False) and print the ratio")
    p.add_argument("--pack-only", action="store_true",
                   help="time the pack only; start no engine (no SGLang needed)")
    p.add_argument("--produce-only", action="store_true",
                   help="time the trainer side of the in-place sync only (pack, fingerprints, "
                        "stacking, flat buckets); start no engine (no SGLang needed)")
    p.add_argument("--device", default="cuda", help="--pack-only / --produce-only: the "
                   "trainer's device (cpu for a smoke run)")
    p.add_argument("--layers", type=int, default=None,
                   help="--pack-only / --produce-only: decoder layers (default: all 48)")
    p.add_argument("--experts", type=int, default=None,
                   help="--pack-only / --produce-only: experts per layer (default: 128)")
    p.add_argument("--table", type=Path, default=None,
                   help="print the table of a saved --out file instead of running")
    p.add_argument("--plot", type=Path, default=None,
                   help="also draw the second syncs' breakdown as a PNG")
    p.add_argument("--quant-impl", choices=("auto", "torch", "triton"), default=None,
                   help="the trainer's quantizer: the formats' fused Triton kernels on CUDA "
                        "(auto, the default) or their torch reference (torch), for A/B runs "
                        "(sets QRL_QUANT_IMPL for the variants' processes)")
    p.add_argument("--profile", default=None, metavar="PATH",
                   help="engine variants: trace the last sync (second; third with +params) "
                        "with torch.profiler; its GPU "
                        "busy vs wall time, top kernels, top host ops, host syncs and the "
                        "direct sync's write range go into the record (key 'profile'), the "
                        "Chrome trace to PATH with the variant's name appended")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quant_impl:
        os.environ["QRL_QUANT_IMPL"] = a.quant_impl
    if a.table:
        if not a.table.is_file():
            p.error(f"--table {a.table}: no such file (a --out file of an earlier run)")
        rows = [json.loads(ln) for ln in a.table.read_text().splitlines() if ln.strip()]
        print(sync_table(rows))
        if a.plot:
            print(f"plot: {plot_sync(rows, a.plot)}")
        return 0
    if a.child:
        return child_main(lambda: child(a.child, a.bucket_mb, a.pack_compare, a.pack_only,
                                        a.produce_only, a.device, a.layers, a.experts,
                                        a.profile, a.model))
    flags = [f for f, on in (("--pack-compare", a.pack_compare), ("--pack-only", a.pack_only),
                             ("--produce-only", a.produce_only)) if on]
    flags += ["--device", a.device, "--model", a.model]
    flags += [x for f, v in (("--layers", a.layers), ("--experts", a.experts),
                             ("--profile", a.profile)) if v is not None for x in (f, str(v))]
    if a.profile and (a.pack_only or a.produce_only):
        p.error("--profile traces an engine variant's second sync; bench/pack_profile.py "
                "traces the pack alone")
    impl = {"quant_impl": os.environ.get("QRL_QUANT_IMPL", "auto")}
    rows = [run_variant([__file__, "--child", v, "--bucket-mb", str(a.bucket_mb), *flags], v,
                        a.out, tag="sync", extra=impl) for v in a.variants.split(",")]
    if a.produce_only:
        print(produce_table(rows))
        return 0
    if a.pack_compare or a.pack_only:
        print("| variant | packed GB | pack s (stacked) | pack s (one at a time) | speedup |\n"
              "|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['variant']} | {r.get('packed_gb', r.get('error', '')[:80])} | "
                  f"{r.get('pack_s', '')} | {r.get('pack_one_s', '')} | "
                  f"{r.get('pack_speedup', '')} |")
        if a.pack_only:
            return 0
    print(sync_table(rows))
    if a.plot:
        print(f"plot: {plot_sync(rows, a.plot)}")
    return 0


PARTS = ("engine", "produce", "stream", "fingerprint", "flatten", "wait", "serialize", "finish",
         "storage", "write", "digest")


def sync_table(rows: list[dict]) -> str:
    """Markdown: per variant, the first and second sync and where the second one went."""
    lines = ["| variant | packed GB | pack s | sync s (first) | sync s (second) | second: "
             + " s | ".join(PARTS) + " s |", "|---|---|---|---|---|" + "---|" * len(PARTS)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error'][:80]} |" + " |" * (3 + len(PARTS)))
        else:
            lines.append(f"| {r['variant']} | {r['packed_gb']} | {r['pack_s']} | {r['sync_s_v1']} "
                         f"| {r['sync_s_v2']} | " + " | ".join(str(r.get(f"{p}_s_v2", ""))
                                                             for p in PARTS) + " |")
    return "\n".join(lines)


def produce_table(rows: list[dict]) -> str:
    """Markdown of ``--produce-only`` rows: the trainer side of each sync, and whether every
    variant left the same fingerprints (they must: the same weights, sent differently)."""
    parts = ("produce", "stream", "fingerprint", "flatten", "finish")
    lines = ["| variant | device | packed GB | " + " | ".join(f"{p} s (1st / 2nd)" for p in parts)
             + " | request items | fingerprints |", "|---|---|---|" + "---|" * (len(parts) + 2)]
    shas = set()
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error'][:80]} |" + " |" * (len(parts) + 3))
            continue
        shas.add(r["fingerprints_sha256"])
        lines.append(f"| {r['variant']} | {r['device']} | {r['packed_gb']} | " + " | ".join(
            f"{r[f'{p}_s_v1']} / {r[f'{p}_s_v2']}" for p in parts)
            + f" | {r['request_items']} | {r['fingerprints']} ({r['fingerprints_sha256']}) |")
    if len(shas) > 1:
        lines.append(f"\nFINGERPRINTS DIFFER between variants: {sorted(shas)}")
    return "\n".join(lines)


def plot_sync(rows: list[dict], path: Path) -> Path:
    """Horizontal bars per variant (second sync): the wall time, the engine's requests, the
    trainer's bucket preparation split into its parts (it runs in the prefetch thread,
    overlapping the engine), and the wait the preparation did not hide."""
    from megatron_qrl.utils.plots import new_figure, save_png

    ok = [r for r in rows if "error" not in r and "sync_s_v2" in r]
    if not ok:
        raise ValueError(f"no variant with a second sync to plot (of {len(rows)} rows)")
    fig, ax = new_figure(figsize=(10, 1.6 + 1.3 * len(ok)))
    bars = ("sync (wall)", "engine requests", "trainer: buckets prepared", "trainer: wait")
    colors = {"stream": "#8fbbd9", "fingerprint": "#f4b183", "flatten": "#c9a0dc",
              "other": "#d9d9d9"}
    ticks, labels = [], []
    for i, r in enumerate(reversed(ok)):
        y0 = i * (len(bars) + 1)
        def get(k: str, r: dict = r) -> float:
            return float(r.get(f"{k}_s_v2", 0.0) or 0.0)

        ax.barh(y0 + 3, get("sync"), color="#404040")
        ax.barh(y0 + 2, get("engine"), color="#5b9bd5")
        left = 0.0
        for part in ("stream", "fingerprint", "flatten"):
            ax.barh(y0 + 1, get(part), left=left, color=colors[part],
                    label=part if i == 0 else None)
            left += get(part)
        ax.barh(y0 + 1, max(get("produce") - left, 0.0), left=left, color=colors["other"],
                label="other" if i == 0 else None)
        ax.barh(y0, get("wait"), color="#c00000")
        ticks += [y0 + k for k in range(len(bars))]
        labels += list(reversed(bars))
        ax.text(get("sync"), y0 + 3, f" {get('sync'):.2f} s", va="center", fontsize=8)
        ax.text(0, y0 + 3.65, r["variant"], fontsize=8, weight="bold")
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel("seconds (second sync)")
    shape = {"qwen3_4b": "Qwen3-4B"}.get(ok[0].get("model"), "Qwen3-30B-A3B")
    ax.set_title(f"Weight sync, {shape} shape, colocated (trainer preparation overlaps "
                 "the engine)", fontsize=9)
    ax.set_ylim(-0.7, len(ok) * (len(bars) + 1) - 0.6)
    ax.legend(title="buckets prepared", fontsize=7, title_fontsize=8, loc="upper left",
              bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return save_png(fig, path)


if __name__ == "__main__":
    sys.exit(main())
