#!/usr/bin/env python3
"""LoRA adapter sync time trainer -> SGLang for the Qwen3-30B-A3B shape (target <= 0.5 s at
r = 32), per rollout format.

    python bench/lora_sync.py --formats fp8,w4a16 --out bench/results/lora_sync.jsonl
    python bench/lora_sync.py --sizes-only            # adapter sizes, no GPU / SGLang

Per format, in its own process: an :class:`~megatron_qrl.rollout_sglang.lora.SGLangLoraEngine`
on the config-only 30B-A3B directory (``load_format="dummy"``, as bench/weight_sync.py, one
H200, colocated) with the LoRA targets :func:`~megatron_qrl.rollout.lora_serving.
resolve_lora_serving` serves for the format (all seven projections when SGLang serves expert
LoRA for it, else attention only); one in-place base sync (the trainer stream of
bench/weight_sync.py: through SGLang's LoRA wrappers); then adapter syncs of random r = 32
BF16 adapters already on the GPU (the trainer's gathered adapter), each scope twice (the first
pays one-time costs; the second is the number an RL step pays):

- ``attn``: q/k/v/o of every layer (QeRL's attention-only adapters);
- ``all``: + gate/up/down of every routed expert (where served);
- ``+noreceipt``: without SGLang's sha256 check of every tensor (``expected_checksums``:
  hashed on the CPU on both sides), i.e. the transport + load alone.

Printed per row: tensors, MB, seconds, and where they went (``prepare_s``: flat bucket,
sha256, CUDA-IPC serialisation; ``load_s``: the engine's deserialise + CPU copy + check;
``unload_s``: the previous adapter's unload), and two 1-token greedy requests after it: the
first moves the adapter from the engine's CPU copy into SGLang's GPU LoRA pool.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._runner import child_main, run_variant  # noqa: E402
from bench.weight_sync import model_config, trainer_stream  # noqa: E402
from megatron_qrl.rollout.lora_adapters import peft_adapter_shapes  # noqa: E402

RANK = 32
SCOPES = ("attn", "attn+noreceipt", "all", "all+noreceipt")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def adapter_bytes(cfg: dict, experts: bool, rank: int = RANK) -> tuple[int, int]:
    """(tensors, bytes in BF16) of a rank-``rank`` adapter."""
    shapes = peft_adapter_shapes(cfg, experts)
    return 2 * len(shapes), sum(2 * rank * (o + i) for o, i in shapes.values())


def make_adapter(cfg: dict, experts: bool, seed: int, device: str = "cuda") -> dict:
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for m, (o, i) in peft_adapter_shapes(cfg, experts).items():
        out[f"{m}.lora_A.weight"] = (torch.randn(RANK, i, generator=g, device=device)
                                     / i ** 0.5).bfloat16()
        out[f"{m}.lora_B.weight"] = (torch.randn(o, RANK, generator=g, device=device)
                                     * 0.01).bfloat16()
    return out


def child(fmt: str, layers: int | None, scopes: list[str]) -> dict:
    import torch

    from megatron_qrl.quant import get_spec
    from megatron_qrl.rollout.lora_serving import resolve_lora_serving
    from megatron_qrl.rollout_sglang import SGLangOptions
    from megatron_qrl.rollout_sglang.launch import write_engine_dir
    from megatron_qrl.rollout_sglang.lora import SGLangLoraEngine, adapter_name

    cfg = model_config(layers)
    serving = resolve_lora_serving("sglang", fmt, ATTN + MLP, is_moe=True, experts=True,
                                   capability=torch.cuda.get_device_capability())
    experts = serving.experts == "adapter"
    res: dict = {"variant": fmt, "layers": cfg["num_hidden_layers"], "rank": RANK,
                 "engine_targets": list(serving.engine_targets)}
    d = write_engine_dir(cfg, fmt, root="/tmp")
    t = time.perf_counter()
    eng = SGLangLoraEngine(d, fmt, SGLangOptions(), lora_rank=RANK,
                           lora_serving=serving, load_format="dummy",
                           mem_fraction_static=0.55, random_seed=0, log_level="warning",
                           enable_return_routed_experts=False)
    res["startup_s"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    eng.update_weights(get_spec(fmt).pack_state_dict(trainer_stream(cfg)), version=0)
    res["base_sync_s"] = round(time.perf_counter() - t, 2)
    from megatron_qrl.rollout.base import SamplingParams

    one = SamplingParams(max_new_tokens=1, temperature=0.0)
    version, rows = 0, []
    bad = sorted(set(scopes) - set(SCOPES))
    if bad:
        raise ValueError(f"--scopes: unknown {bad}; choose from {', '.join(SCOPES)}")
    for scope in [s for s in scopes if experts or not s.startswith("all")]:
        eng.options = eng.options.replace(receipt="noreceipt" not in scope)
        full = scope.startswith("all")
        for rep in (1, 2):
            version += 1
            tensors = make_adapter(cfg, full, version)
            torch.cuda.synchronize()
            t = time.perf_counter()
            eng.load_lora_adapter(adapter_name(version), tensors, {
                "peft_type": "LORA", "r": RANK, "lora_alpha": RANK,
                "target_modules": list(ATTN + (MLP if full else ()))}, version=version)
            s = time.perf_counter() - t
            n, nbytes = adapter_bytes(cfg, full)
            lap = {k: round(v, 3) for k, v in eng.last_sync.items() if k.endswith("_s")}
            gen = []  # the first request also moves the adapter into SGLang's GPU LoRA pool
            for _ in range(2):
                t = time.perf_counter()
                eng.generate([[1000 + i for i in range(16)]], one)
                gen.append(round(time.perf_counter() - t, 3))
            rows.append({"scope": scope, "rep": rep, "tensors": n, "mb": round(nbytes / 2**20, 1),
                         "seconds": round(s, 3), "first_generate_s": gen[0],
                         "next_generate_s": gen[1]} | lap)
            del tensors
    out = eng.generate([[1000 + i for i in range(16)]], SamplingParams(max_new_tokens=8,
                                                                        temperature=0.0))
    res["generated_tokens"] = int(out.mask.sum())
    res["adapter_syncs"] = rows
    eng.shutdown()
    return res


def table(rows: list[dict]) -> str:
    lines = ["| format | scope | tensors | MB | sync s (first) | sync s (second) | second: "
             "prepare s | load s | unload s | 1st generate s | next generate s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error'][:100]} |" + " |" * 9)
            continue
        by = {}
        for s in r["adapter_syncs"]:
            by.setdefault(s["scope"], {})[s["rep"]] = s
        for scope, reps in by.items():
            a, b = reps[1], reps[2]
            lines.append(f"| {r['variant']} | {scope} | {a['tensors']} | {a['mb']} | "
                         f"{a['seconds']} | {b['seconds']} | {b.get('prepare_s', '')} | "
                         f"{b.get('load_s', '')} | {b.get('unload_s', '')} | "
                         f"{b.get('first_generate_s', '')} | {b.get('next_generate_s', '')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="fp8")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: all 48)")
    p.add_argument("--scopes", default=",".join(SCOPES),
                   help=f"adapter syncs to time, each twice ({', '.join(SCOPES)})")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--sizes-only", action="store_true",
                   help="print the adapter sizes of the 30B-A3B shape at r = 32 (no GPU)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.sizes_only:
        cfg = model_config(a.layers)
        for experts in (False, True):
            n, nbytes = adapter_bytes(cfg, experts)
            print(f"r={RANK} {'attention + experts' if experts else 'attention'}: {n} tensors, "
                  f"{nbytes / 2**20:.1f} MiB (BF16), {cfg['num_hidden_layers']} layers")
        return 0
    if a.child:
        return child_main(lambda: child(a.child, a.layers, a.scopes.split(",")))
    extra = (["--layers", str(a.layers)] if a.layers else []) + ["--scopes", a.scopes]
    rows = [run_variant([__file__, "--child", f, *extra], f, a.out, tag="lora_sync")
            for f in a.formats.split(",")]
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
