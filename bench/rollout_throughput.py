#!/usr/bin/env python3
"""Rollout decode throughput of each format on SGLang, as ratios to BF16 from the same run.

    python bench/rollout_throughput.py --variants bf16,fp8_block,fp8_block:sglang,fp8,int8 \
        --batches 256,64 --new 512 --out bench/results/throughput.jsonl

Each variant starts its own ``sglang.Engine`` (fresh process, ``load_format="dummy"``) on a
Qwen3-30B-A3B-shaped config (``megatron_qrl/data/configs/qwen3_30b_a3b.json``) whose
``quantization_config`` is the one our export writes for the format
(``QuantSpec.hf_quantization_config``), with the engine arguments SGLangEngine uses. Variant
``FMT`` uses the fused-MoE configs shipped in megatron_qrl (tools/tune_fused_moe.py),
``FMT:sglang`` SGLang's own (its shipped file or its default heuristic). 128 random prompt
tokens, ``--new`` generated tokens, ignore_eos; decode tok/s excludes the prefill time.
Also printed: weight bytes read per decode step / step time as a fraction of the device-to-
device copy bandwidth measured at the start of the run.

Variant options (``FMT:OPT+OPT``, bench/engine_variants.py has the SGLang 0.5.17 facts):
``sglang`` (SGLang's own fused-MoE configs), ``fa3`` (FA3 attention instead of Triton),
``flashinfer`` (FlashInfer attention, nvcc JIT at start), ``deepgemm`` (DeepGEMM for the
block-FP8 dense GEMMs and MoE; ``fp8_block`` only: per-channel ``fp8`` never calls DeepGEMM in
SGLang 0.5.17), ``deepgemm_dense`` (dense GEMMs only). An unknown option stops the run before
any engine starts, with the list of known ones.

The device calls that measure FA3 and DeepGEMM, one warm ``nvidia-h200`` (its /tmp
keeps the site, FA3 and the DeepGEMM cache; ~25 min of device time in all):

0. here, once: ``bash tools/stage_fa3.sh`` (~4 min on 2 cores) -> ``.stage/fa3_0..2``.
1. carry ``.stage/s1 .stage/recipe .stage/stub``: ``source .stage/recipe/setup.sh &&
   nvidia-smi -L`` (unpacks the site; ~1 min after the machine starts).
2. carry ``.stage/recipe .stage/stub .stage/fa3_N``, N = 0, 1, 2 (one 57 MB part per call):
   ``bash bench/h200.sh fa3-part N`` (~20 s each).
3. ``bash bench/h200.sh fa3-install`` (~1 min): sha256, unpack, tools/check_fa3.py must print
   ``FA3 OK`` (prefill + paged decode vs SDPA).
4. ``VARIANTS=bf16,bf16:fa3,fp8,fp8:fa3 bash bench/h200.sh run throughput:580`` (~6 min:
   ~80 s per variant, the first bf16 ~150 s).
5. ``VARIANTS=fp8_block:deepgemm bash bench/h200.sh run throughput:580``: DeepGEMM's nvcc JIT
   of the kernels this run uses, into /tmp/deep_gemm_cache (unmeasured; a few minutes?). Its
   numbers count only if step 6 agrees (no compile in its timed region, but a cold start).
6. ``VARIANTS=bf16,fp8_block,fp8_block:deepgemm_dense,fp8_block:deepgemm,fp8_block:fa3+deepgemm
   bash bench/h200.sh run throughput:580`` (~7 min with the cache warm). Optional, if time is
   left: ``fp8:flashinfer`` (FlashInfer's own JIT at start).

Print saved runs with ``--table F.jsonl [G.jsonl ...]``; each record carries every engine
argument the variant ran with (``engine_kwargs``: SGLangEngine's, the bench's, the variant's
and ``--extra``), the variant's own (``variant_engine_kwargs``), ``extra``, the shape
(``prompt_len``, ``new``), the KV-cache capacity (``max_total_num_tokens``) and ``env``.

RL lengths and the KV-cache table: ``--preset rl-512`` (512 prompt + 1,536 new,
batches 256,128) or ``--preset rl-1024`` (1,024 + 4,096, batch 128) with ``--variants kv``
(bf16, fp8, fp8 + fp8 KV, int8 + fp8 KV, w4a16 + fp8 KV, bf16 + fp8 KV; ``FMT:kv_fp8_e4m3``
runs the engine exactly as ``--qrl-rollout-kv-cache fp8_e4m3`` does). On the H200:
``PRESET=rl-512 VARIANTS=bf16,fp8,fp8:kv_fp8_e4m3 bash bench/h200.sh run kvthroughput:580``
then ``VARIANTS=int8:kv_fp8_e4m3,w4a16:kv_fp8_e4m3,bf16:kv_fp8_e4m3`` (about 2.5 min per
variant at rl-512, one device call holds three), the same for ``PRESET=rl-1024``; merge the
calls' ``kvthroughput.jsonl`` with ``--table``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._fleet import barrier, engines_per_gpu, fleet_scaling, run_fleet  # noqa: E402
from bench._runner import child_main, run_variant  # noqa: E402
from bench.engine_variants import child_env, parse_variant  # noqa: E402

MODEL_CONFIG = ROOT / "megatron_qrl" / "data" / "configs" / "qwen3_30b_a3b.json"

PRESETS: dict[str, dict] = {
    "short": {"prompt_len": 128, "new": 512, "batches": "256,64"},
    "rl-512": {"prompt_len": 512, "new": 1536, "batches": "256,128"},
    "rl-1024": {"prompt_len": 1024, "new": 4096, "batches": "128"},
}
"""``--preset``: prompt length, new tokens and batch sizes (RL lengths; at 1,024 +
4,096 a batch of 256 does not fit BF16 K/V next to the 30B-A3B weights on one H200)."""

VARIANT_SETS: dict[str, str] = {
    "kv": "bf16,fp8,fp8:kv_fp8_e4m3,int8:kv_fp8_e4m3,w4a16:kv_fp8_e4m3,bf16:kv_fp8_e4m3",
}
"""``--variants NAME`` shorthands: ``kv`` = the KV-cache table of docs/BENCHMARKS.md."""


def copy_bandwidth_gbs(gib: int = 4, reps: int = 10) -> float:
    """Device-to-device copy bandwidth (read + write bytes / s), GB/s."""
    import torch

    n = gib * 2**30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / reps
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / dt / 1e9


def engine_kwargs(variant: str, batches: list[int], extra: dict, model_path: str) -> dict:
    """Every ``sglang.Engine`` argument one variant runs with: SGLangEngine's for the format,
    the bench's own, the variant's options, then ``--extra`` (later ones win)."""
    from megatron_qrl.rollout_sglang.engine import engine_args_for

    plan = parse_variant(variant)
    kw = engine_args_for(plan.fmt, is_moe=True)
    kw |= {"model_path": model_path, "load_format": "dummy",
           "mem_fraction_static": 0.85 / engines_per_gpu(),
           "enable_return_routed_experts": False, "cuda_graph_max_bs_decode": max(batches),
           "cuda_graph_bs_decode": sorted({1, *batches}), "cuda_graph_backend_prefill": "disabled",
           "random_seed": 0, "log_level": "warning"}
    return kw | plan.engine_kwargs | extra


def model_config(layers: int | None = None) -> dict:
    """The Qwen3-30B-A3B config the engines run; ``layers``: keep only the first ``layers``
    decoder layers (``--layers``; None: all 48). Weights and K/V per token shrink together,
    so a trimmed stack keeps each layer's read mix; the embedding and lm_head (unquantized in
    every variant) then weigh more, which lowers the quantized variants' ratios, not raises."""
    cfg = json.loads(MODEL_CONFIG.read_text())
    if layers is not None:
        if not 1 <= layers <= cfg["num_hidden_layers"]:
            raise SystemExit(f"--layers {layers}: choose 1..{cfg['num_hidden_layers']} (the "
                             f"layers of {MODEL_CONFIG.name})")
        cfg["num_hidden_layers"] = layers
        cfg["max_window_layers"] = min(cfg.get("max_window_layers", layers), layers)
    return cfg


def child(variant: str, batches: list[int], new: int, prompt_len: int, extra: dict,
          layers: int | None = None) -> dict:
    """Run one variant in this process; returns its result record."""
    import sglang

    from megatron_qrl.rollout_sglang.launch import write_engine_dir

    plan = parse_variant(variant)
    fmt = plan.fmt
    cfg = model_config(layers)
    d = write_engine_dir(cfg, fmt, root="/tmp")
    kw = engine_kwargs(variant, batches, extra, str(d))
    t0 = time.time()
    eng = sglang.Engine(**kw)
    res = {"variant": variant, "format": fmt, "moe_config_dir": os.environ.get("SGLANG_MOE_CONFIG_DIR"),
           "startup_s": round(time.time() - t0, 1), "engine_kwargs": kw,
           "variant_engine_kwargs": plan.engine_kwargs, "extra": extra,
           "prompt_len": prompt_len, "new": new, "layers": cfg["num_hidden_layers"],
           "env": {k: os.environ.get(k) for k in {**plan.env_defaults, **plan.env}}}
    info = eng.get_server_info()
    res["max_total_num_tokens"] = info.get("max_total_num_tokens")  # KV-cache capacity
    for st in info.get("internal_states", [])[:1]:
        res["weight_gb"] = st.get("memory_usage", {}).get("weight")
    rng = random.Random(0)
    for bs in batches:
        ids = [[rng.randrange(1000, 150000) for _ in range(prompt_len)] for _ in range(bs)]
        sp = {"max_new_tokens": new, "ignore_eos": True, "temperature": 1.0}
        eng.generate(input_ids=ids, sampling_params={**sp, "max_new_tokens": 32})  # warm-up
        barrier(f"bs{bs}")  # --engines N: every engine decodes at once
        t = time.time()
        out = eng.generate(input_ids=ids, sampling_params=sp)
        dt = time.time() - t
        tp = time.time()
        eng.generate(input_ids=ids, sampling_params={**sp, "max_new_tokens": 1})
        tp = time.time() - tp
        ntok = sum(len(o["output_ids"]) for o in out)
        res[f"bs{bs}"] = {"out_tokens": ntok, "wall_s": round(dt, 3), "prefill_s": round(tp, 3),
                          "decode_tok_s": round((ntok - bs) / max(dt - tp, 1e-6), 1)}
        print("STEP", variant, json.dumps(res[f"bs{bs}"]), flush=True)
    eng.shutdown()
    return res


def _env_for(variant: str) -> dict:
    plan = parse_variant(variant)
    d = None
    if plan.own_moe_configs:
        from megatron_qrl.rollout_sglang.kernels.moe_configs import config_dir_for_engine

        d = config_dir_for_engine()
    return child_env(plan, dict(os.environ), d)


def table(results: list[dict], batches: list[int], bw_gbs: float) -> str:
    base = next((r for r in results if r["variant"] == "bf16" and "error" not in r), None)
    shapes = sorted({f"{r['prompt_len']} prompt + {r['new']} new"
                     + (f", {r['layers']} layers" if r.get("layers", 48) != 48 else "")
                     for r in results if "new" in r})
    lines = [f"device-to-device copy bandwidth: {bw_gbs:.0f} GB/s; shape: {', '.join(shapes)}", "",
             "| variant | weights GB | " + " | ".join(
                 f"bs {b} decode tok/s (x bf16) | bs {b} weight-read BW share" for b in batches)
             + " |", "|---|---|" + "---|---|" * len(batches)]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error'][:80]} |")
            continue
        cells = []
        for b in batches:
            x = r[f"bs{b}"]["decode_tok_s"]
            ratio = f"{x / base[f'bs{b}']['decode_tok_s']:.2f}" if base else "n/a"
            step_s = b / x
            share = (r.get("weight_gb") or 0) * 1.073741824 / step_s / bw_gbs
            cells += [f"{x:,.0f} ({ratio})", f"{share:.0%}"]
        lines.append(f"| {r['variant']} | {r.get('weight_gb') or 0:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def resolve(a: argparse.Namespace) -> argparse.Namespace:
    """Apply ``--preset`` (explicit ``--prompt-len`` / ``--new`` / ``--batches`` win) and the
    ``--variants`` shorthands; a misspelt variant option raises before any engine starts."""
    preset = PRESETS[a.preset]
    for key in ("prompt_len", "new", "batches"):
        if getattr(a, key) is None:
            setattr(a, key, preset[key])
    a.variants = VARIANT_SETS.get(a.variants, a.variants)
    for v in a.variants.split(","):
        parse_variant(v)
    return a


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="bf16,fp8_block,fp8,int8",
                   help=f"comma-separated FMT[:OPT+OPT] or one of {sorted(VARIANT_SETS)}")
    p.add_argument("--preset", choices=sorted(PRESETS), default="short",
                   help="; ".join(f"{k}: {v}" for k, v in PRESETS.items()))
    p.add_argument("--batches", default=None)
    p.add_argument("--new", type=int, default=None)
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--extra", default="{}", help="JSON of extra sglang.Engine arguments")
    p.add_argument("--layers", type=int, default=None,
                   help="the first N of the 30B-A3B shape's 48 layers (default: all): RL-length "
                        "ratios in a fraction of the device time (model_config)")
    p.add_argument("--out", type=Path, default=None, help="append result records (JSONL)")
    p.add_argument("--table", type=Path, nargs="+", default=None,
                   help="print the table of saved --out JSONL files (no GPU needed) and exit")
    p.add_argument("--engines", type=int, default=1,
                   help="N engines at once (bench/_fleet.py): 1/N of the memory and of each "
                        "batch each; reports the fleet's tok/s (one GPU: a sanity check)")
    p.add_argument("--gpus", type=int, default=1,
                   help="spread the --engines over this many GPUs (engine i on GPU i %% N; "
                        "N divides --engines): the fleet's scaling on a multi-GPU machine")
    p.add_argument("--scaling", type=Path, nargs="+", default=None,
                   help="print each --engines N record of these --out files over the one-engine "
                        "record of its variant (same total batch / same batch per engine), exit")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = resolve(p.parse_args(argv))
    batches = [int(b) for b in a.batches.split(",")]
    if a.scaling:
        rows = [json.loads(ln) for f in a.scaling for ln in f.read_text().splitlines() if ln.strip()]
        for r in fleet_scaling(rows):
            print("[fleet scaling] " + json.dumps(r))
        return 0
    if a.table:
        rows = [json.loads(ln) for f in a.table for ln in f.read_text().splitlines() if ln.strip()]
        print(table(rows, batches, rows[0]["copy_bw_gbs"]))
        return 0
    if a.child:
        return child_main(lambda: child(a.child, batches, a.new, a.prompt_len,
                                        json.loads(a.extra), a.layers))
    variants = a.variants.split(",")
    model_config(a.layers)  # a bad --layers stops here, before any engine
    lay = [] if a.layers is None else ["--layers", str(a.layers)]
    if a.engines > 1 and any(b % a.engines for b in batches):
        p.error(f"--engines {a.engines} must divide every --batches size ({a.batches})")
    if a.gpus < 1 or a.engines % a.gpus:
        p.error(f"--gpus {a.gpus} must be >= 1 and divide --engines {a.engines}")
    bw = copy_bandwidth_gbs()
    print(f"[bench] copy bandwidth {bw:.0f} GB/s", flush=True)
    results = []
    per = ",".join(str(b // a.engines) for b in batches)
    for v in variants:
        if a.engines > 1:
            res = run_fleet(lambda env, tag, v=v: run_variant(
                [__file__, "--child", v, "--batches", per, "--new", str(a.new), "--prompt-len",
                 str(a.prompt_len), "--extra", a.extra, *lay], f"{v} {tag}", None, env),
                _env_for(v), a.engines, batches, a.gpus) | {"copy_bw_gbs": round(bw, 1)}
            results.append(res)
            if a.out is not None:
                with a.out.open("a") as f:
                    f.write(json.dumps(res) + "\n")
            continue
        results.append(run_variant(
            [__file__, "--child", v, "--batches", a.batches, "--new", str(a.new),
             "--prompt-len", str(a.prompt_len), "--extra", a.extra, *lay], v, a.out, _env_for(v),
            extra={"copy_bw_gbs": round(bw, 1)}))
    print(table(results, batches, bw), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
