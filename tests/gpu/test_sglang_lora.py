"""H200: SGLang serving LoRA adapters (loaded from tensors) on its QUANTIZED base, vs the
reference fed the same base and adapter.

    source .stage/recipe/setup.sh
    PYTHONUNBUFFERED=1 python -m pytest -q tests/gpu/test_sglang_lora.py -x -s

Per case, in its own process (``python tests/gpu/test_sglang_lora.py FMT EXPERTS OUT.json``,
one engine each): the tiny Qwen3-MoE of tests/gpu/test_sglang_inplace.py exported in the
format; :class:`~megatron_qrl.rollout_sglang.lora.SGLangLoraEngine` started on it with the
serving :func:`~megatron_qrl.rollout.lora_serving.resolve_lora_serving` gives (its targets;
CUDA graphs on except the expert cases, which run SGLang's Marlin LoRA MoE runner eagerly:
``LoraServing.eager_reason``; a failed worker's last output lines are in the pytest failure
message: ``tests.gpu.run_json_worker``); base weights A synced in place (version 0: the
in-place loader through SGLang's LoRA wrappers); adapter 1 loaded from tensors (``policy_v1``, flattened bucket, SGLang's
sha256 check of every tensor) and greedy-generated; adapter 2 loaded (``policy_v2``; v1
unloaded) and generated again; a request naming ``policy_v1`` must then fail. The parent
teacher-forces the reference (:class:`ReferenceEngine`: A's dequantized packed weights,
W8A8 activation fake quant, attention adapters as hooks on the raw input, expert adapters
added to the dequantized expert weights) on the engine's tokens for each adapter and checks
greedy agreement / |dlogp| within test_sglang_inplace.py's LIMITS; adapter 2's tokens must
not be adapter 1's (the update reached the engine).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
if __name__ != "__main__":  # pytest: skip before importing the GPU helpers
    from tests.gpu import run_json_worker, skip_unless_sglang_gpu

    skip_unless_sglang_gpu("SGLang LoRA serving tests")

from test_sglang_inplace import (  # noqa: E402
    CFG_PATH,
    LIMITS,
    MARLIN,
    MAX_OVERLAP_WITH_A,
    prompts,
    source_model,
    teacher_forced,
)

RANK, ALPHA = 8, 16.0
CASES = [("fp8", False), ("w4a16", False), ("w4a16", True), ("nvfp4", False), ("nvfp4", True)]
"""(format, adapters on the routed experts too): W8A8 (Triton) and the Marlin formats; the
expert cases run SGLang's Marlin LoRA MoE runner (w4a16: ``moe_runner_backend="marlin"``,
rollout_sglang/lora.py ``EXPERT_LORA_MOE_RUNNER``; nvfp4: ModelOpt's own Marlin runner on
sm90) with CUDA graphs off (``LoraServing.eager_reason``: SGLang 0.5.17 crashes at start
otherwise). Every case is an adapter case (``resolve_lora_serving``: nothing merged)."""
NEW_TOKENS = 16


def cfg() -> dict:
    return json.loads(CFG_PATH.read_text())


def targets(experts: bool) -> tuple[str, ...]:
    attn = ("q_proj", "k_proj", "v_proj", "o_proj")
    return attn + (("gate_proj", "up_proj", "down_proj") if experts else ())


def peft_config(experts: bool) -> dict:
    return {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0,
            "target_modules": list(targets(experts)), "bias": "none", "task_type": "CAUSAL_LM"}


def adapter(seed: int, experts: bool) -> dict[str, torch.Tensor]:
    """Random PEFT adapter tensors (bf16): ``A`` ~ N(0, 1/in), ``B`` ~ N(0, 0.05^2); with
    alpha/r = 2 the update is about the size of the weights (std 0.02), so tokens change."""
    from megatron_qrl.rollout.lora_adapters import peft_adapter_shapes

    g = torch.Generator().manual_seed(seed)
    out = {}
    for pre, (o, n) in peft_adapter_shapes(cfg(), experts).items():
        out[f"{pre}.lora_A.weight"] = (torch.randn(RANK, n, generator=g) / n ** 0.5).bfloat16()
        out[f"{pre}.lora_B.weight"] = (torch.randn(o, RANK, generator=g) * 0.05).bfloat16()
    return out


# ---- worker (one engine, own process) --------------------------------------------------
def worker(fmt: str, experts: bool, out: Path) -> None:
    from megatron_qrl.models.export import export_quantized
    from megatron_qrl.quant import get_spec
    from megatron_qrl.quant.hf_reference import hf_tensors
    from megatron_qrl.rollout import SamplingParams
    from megatron_qrl.rollout.lora_serving import resolve_lora_serving
    from megatron_qrl.rollout_sglang import SGLangOptions
    from megatron_qrl.rollout_sglang.lora import SGLangLoraEngine, adapter_name

    work = out.parent / f"work-{fmt}-{int(experts)}"
    a = source_model(0)
    a.save_pretrained(work / "hf-a")
    export_quantized(work / "hf-a", fmt, work / fmt, overwrite=True, progress=False)
    serving = resolve_lora_serving("sglang", fmt, targets(experts), is_moe=True,
                                   experts=experts, capability=torch.cuda.get_device_capability())
    res: dict = {"fmt": fmt, "experts": experts, "serving": serving.__dict__ | {}}
    assert not serving.merges, f"{fmt} experts={experts}: not an adapter case ({serving})"
    t0 = time.time()
    engine = SGLangLoraEngine(work / fmt, fmt, SGLangOptions(), lora_rank=RANK,
                              lora_serving=serving, mem_fraction_static=0.3,
                              random_seed=0)
    res["startup_s"] = round(time.time() - t0, 1)
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0)
    try:
        engine.update_weights(get_spec(fmt).pack_state_dict(hf_tensors(a)), 0)
        res["sync_base"] = dict(engine.last_sync)
        for v in (1, 2):
            tensors = adapter(v, experts)
            engine.load_lora_adapter(adapter_name(v), tensors, peft_config(experts), version=v)
            res[f"sync_v{v}"] = dict(engine.last_sync)
            o = engine.generate(prompts(), greedy)
            res[f"out_v{v}"] = {"ids": o.output_ids.tolist(), "lp": o.logprobs.tolist(),
                                "mask": o.mask.tolist(), "version": o.weight_version}
            print(f"[lora worker] {fmt} experts={experts}: v{v} {res[f'sync_v{v}']}", flush=True)
        try:  # the replaced adapter is gone from the engine
            engine.engine.generate(input_ids=[prompts()[0]], lora_path=[adapter_name(1)],
                                   sampling_params={"max_new_tokens": 1})
            res["v1_still_served"] = True
        except Exception as exc:  # noqa: BLE001 - SGLang's error type is not part of its API
            res["v1_still_served"] = False
            res["v1_error"] = str(exc)[:200]
    finally:
        out.write_text(json.dumps(res))
        engine.shutdown()


# ---- parent (pytest) ---------------------------------------------------------------------
def reference(fmt: str, experts: bool, v: int):
    """Base A's dequantized packed weights, adapter ``v`` on top (module doc)."""
    from sglang_reference import _assign

    from megatron_qrl.quant import get_spec
    from megatron_qrl.quant.hf_reference import hf_tensors
    from megatron_qrl.rollout.lora_serving import hf_weight_of
    from megatron_qrl.rollout.reference import ReferenceEngine

    ref = ReferenceEngine(cfg(), fmt, device="cuda", dtype=torch.bfloat16)
    ref.update_weights(get_spec(fmt).pack_state_dict(hf_tensors(source_model(0))), 0)
    tensors = adapter(v, experts)
    attn = {k: t for k, t in tensors.items() if ".self_attn." in k}
    ref.load_lora_adapter(f"v{v}", attn, peft_config(experts), v)
    held = dict(hf_tensors(ref.model))
    params = dict(ref.model.named_parameters())
    with torch.no_grad():
        for k in tensors:
            if ".experts." in k and k.endswith("lora_A.weight"):
                w = hf_weight_of(k)
                a_, b_ = tensors[k].float(), tensors[k.replace("lora_A", "lora_B")].float()
                merged = held[w].float().cuda() + (ALPHA / RANK) * (b_ @ a_).cuda()
                _assign(params, w, merged)
    return ref


def check(fmt: str, experts: bool, res: dict, v: int) -> dict:
    ref = reference(fmt, experts, v)
    o = res[f"out_v{v}"]
    agree, diffs = [], []
    for i, p in enumerate(prompts()):
        toks = [t for t, m in zip(o["ids"][i], o["mask"][i]) if m]
        ref_lp, ref_greedy = teacher_forced(ref, p, toks)
        agree += [int(t == g) for t, g in zip(toks, ref_greedy)]
        diffs += [abs(x - y) for x, y in zip(o["lp"][i][: len(toks)], ref_lp)]
    del ref
    torch.cuda.empty_cache()
    return {"agree": sum(agree) / len(agree), "max": max(diffs),
            "mean": sum(diffs) / len(diffs)}


def overlap(res: dict) -> float:
    a, b = res["out_v1"], res["out_v2"]
    same = n = 0
    for i in range(len(prompts())):
        ta = [t for t, m in zip(a["ids"][i], a["mask"][i]) if m]
        tb = [t for t, m in zip(b["ids"][i], b["mask"][i]) if m]
        same += sum(int(x == y) for x, y in zip(ta, tb))
        n += min(len(ta), len(tb))
    return same / max(n, 1)


def run_worker(fmt: str, experts: bool, tmp: Path) -> dict:
    out = tmp / f"{fmt}-{int(experts)}.json"
    return run_json_worker(__file__, [fmt, str(int(experts)), str(out)], out, "out_v2",
                           f"{fmt} experts={experts}: the LoRA worker")


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2] == "1", Path(sys.argv[3]))
    raise SystemExit(0)

import pytest  # noqa: E402


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,experts", CASES)
def test_adapter_from_tensors_on_quantized_base_matches_reference(tmp_path, fmt, experts):
    if fmt in MARLIN:  # the Marlin kernels JIT-compile on first use (bench/h200.sh setup)
        print(f"[lora] {fmt}: needs the Marlin JIT (the h200.sh setup prewarm)", flush=True)
    res = run_worker(fmt, experts, tmp_path)
    floor, max_diff, mean_diff = LIMITS[fmt]
    for v in (1, 2):
        s = res[f"sync_v{v}"]
        assert s["verified"] == "sha256" and res[f"out_v{v}"]["version"] == v, s
        m = check(fmt, experts, res, v)
        print(f"\n[lora] {fmt:6s} experts={int(experts)} adapter v{v}: greedy agreement "
              f"{m['agree']:.3f}  max|dlogp| {m['max']:.3f}  mean|dlogp| {m['mean']:.4f}  "
              f"adapter load {s['seconds']:.3f} s ({s['tensors']} tensors)  base sync "
              f"{res['sync_base']['seconds']:.2f} s  (engine start {res['startup_s']} s)",
              flush=True)
        assert m["agree"] >= floor and m["max"] < max_diff and m["mean"] < mean_diff, (
            f"{fmt} experts={experts} adapter v{v}: engine vs reference (quantized base + "
            f"adapter): agreement {m['agree']:.3f} (floor {floor}), max|dlogp| {m['max']:.3f} "
            f"(< {max_diff}), mean {m['mean']:.4f} (< {mean_diff})")
    ov = overlap(res)
    print(f"[lora] {fmt:6s} experts={int(experts)} token overlap v1/v2 {ov:.3f}; v1 after "
          f"unload: {res.get('v1_error', 'still served')}", flush=True)
    assert ov <= MAX_OVERLAP_WITH_A, (
        f"{fmt}: adapter 2 left adapter 1's tokens ({ov:.2f} overlap): the update did not "
        "reach the engine's LoRA buffers")
    assert res["v1_still_served"] is False, f"{fmt}: policy_v1 was not unloaded"
