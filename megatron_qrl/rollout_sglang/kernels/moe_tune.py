"""Tuning SGLang's Triton fused-MoE kernel for our formats' MoE shapes.

SGLang picks a fused-MoE tile configuration per token count ``M`` from a JSON file named by
``get_config_file_name(E, N, dtype, block_shape, per_channel_quant)``; without one it runs a
generic default. This module times candidate configurations of the real kernel
(``sglang...triton_utils.fused_moe`` under ``override_config``) on random weights of the
format's layout and keeps the fastest per ``M``. The search is two-stage to fit a short GPU
lease: tile shapes at fixed warps/stages first, then warps/stages/group size around the best
tiles of each ``M``.

Pure parts (search space, formats' kernel flags) import nothing from SGLang; the timing
functions need a CUDA GPU and SGLang (``tools/tune_fused_moe.py`` drives them).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from ...quant import get_spec, list_specs
from ...quant.engine_facts import KernelFlags

__all__ = ["KernelFlags", "MoeCase", "TUNE_FORMATS", "best_per_m", "make_case", "stage1_space",
           "stage2_space", "time_config"]

DEFAULT_M = (1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
"""Token counts tuned: decode batch sizes (CUDA-graph sizes) and prefill chunks."""


TUNE_FORMATS: dict[str, KernelFlags] = {
    name: get_spec(name).engine.moe_kernel for name in list_specs()
    if get_spec(name).engine.moe_kernel is not None}
"""Formats whose MoE runs SGLang's Triton fused-MoE kernel on Hopper, with its flags, as each
format declares them (:attr:`megatron_qrl.quant.engine_facts.EngineFacts.moe_kernel`); the
others (w4a16, nvfp4) run Marlin kernels (no Triton tile configuration)."""


def _valid(cfg: dict, flags: KernelFlags) -> bool:
    if flags.block_shape is not None:  # block-quant kernel: tiles inside one scale block
        bn, bk = flags.block_shape
        return bn % cfg["BLOCK_SIZE_N"] == 0 and bk % cfg["BLOCK_SIZE_K"] == 0
    return True


def stage1_space(flags: KernelFlags) -> list[dict]:
    """Tile shapes at ``num_warps=4, num_stages=3, GROUP_SIZE_M=16``."""
    out = []
    for bm, bn, bk in itertools.product((16, 32, 64, 128), (64, 128), (64, 128, 256)):
        cfg = {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "GROUP_SIZE_M": 16,
               "num_warps": 4, "num_stages": 3}
        if _valid(cfg, flags):
            out.append(cfg)
    return out


def stage2_space(tiles: Iterable[dict]) -> list[dict]:
    """Warps x pipeline stages around the given tiles (duplicates removed)."""
    seen, out = set(), []
    for t in tiles:
        for nw, ns in itertools.product((4, 8), (3, 4, 5)):
            cfg = {**t, "num_warps": nw, "num_stages": ns}
            key = tuple(sorted(cfg.items()))
            if key not in seen:
                seen.add(key)
                out.append(cfg)
    return out


def best_per_m(timings: dict[int, list[tuple[float, dict]]], top: int = 1) -> dict[int, list[dict]]:
    """The ``top`` fastest configurations per ``M`` (failed configurations carry ``inf``)."""
    return {m: [c for _, c in sorted(ts, key=lambda tc: tc[0])[:top]]
            for m, ts in timings.items()}


@dataclass
class MoeCase:
    """Random weights of one format in the layout SGLang's MoE method hands the kernel."""

    name: str
    flags: KernelFlags
    w1: torch.Tensor
    w2: torch.Tensor
    w1_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None

    @property
    def E(self) -> int:
        return self.w1.shape[0]

    @property
    def N(self) -> int:
        return self.w2.shape[2]

    @property
    def K(self) -> int:
        return self.w1.shape[2]


def make_case(fmt: str, E: int, N: int, K: int, device: str = "cuda", seed: int = 0) -> MoeCase:
    """``w1 [E, 2N, K]`` (gate|up), ``w2 [E, K, N]`` and scales for ``fmt``."""
    flags = get_spec(fmt).engine.moe_kernel if fmt in list_specs() else None
    if flags is None:
        raise ValueError(f"format {fmt!r}: the Triton fused-MoE kernel runs {sorted(TUNE_FORMATS)}"
                         " (w4a16/nvfp4 use Marlin, which has no tile configuration)")
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32)

    w1, w2 = rand(E, 2 * N, K) * 0.02, rand(E, K, N) * 0.02
    if not (flags.use_int8_w8a8 or flags.use_fp8_w8a8):  # the unquantized kernel
        return MoeCase(fmt, flags, w1.bfloat16(), w2.bfloat16(), None, None)
    if flags.use_int8_w8a8:
        def q(w: torch.Tensor) -> torch.Tensor:
            return (w * 127 / 0.08).round().clamp(-127, 127).to(torch.int8)

        s1, s2 = (torch.full((E, 2 * N, 1), 0.08 / 127, device=device),
                  torch.full((E, K, 1), 0.08 / 127, device=device))
        return MoeCase(fmt, flags, q(w1), q(w2), s1, s2)
    w1q, w2q = (w1 * 1e4).to(torch.float8_e4m3fn), (w2 * 1e4).to(torch.float8_e4m3fn)
    if flags.block_shape is None:
        s1, s2 = (torch.full((E, 2 * N, 1), 1e-4, device=device),
                  torch.full((E, K, 1), 1e-4, device=device))
    else:
        bn, bk = flags.block_shape
        s1 = torch.full((E, -(-2 * N // bn), -(-K // bk)), 1e-4, device=device)
        s2 = torch.full((E, -(-K // bn), -(-N // bk)), 1e-4, device=device)
    return MoeCase(fmt, flags, w1q, w2q, s1, s2)


def routing(M: int, E: int, top_k: int, device: str = "cuda", seed: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax top-k routing of random router logits (Qwen3-MoE: renormalised top-k)."""
    g = torch.Generator(device=device).manual_seed(seed + M)
    logits = torch.randn(M, E, generator=g, device=device, dtype=torch.float32)
    w, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return (w / w.sum(-1, keepdim=True)), ids.to(torch.int32), logits


def time_config(case: MoeCase, M: int, top_k: int, config: dict | None, *, reps: int = 20,
                graph: bool = True) -> float:
    """Microseconds per fused-MoE call (both GEMMs, routing alignment and activation) of
    ``case`` at ``M`` tokens with ``config`` (None: SGLang's own choice). ``inf`` if the
    configuration fails to compile or run (e.g. too much shared memory)."""
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.moe.moe_runner.triton_utils import override_config
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import fused_moe
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    x0 = torch.randn(M, case.K, device=case.w1.device, dtype=torch.bfloat16)
    x = x0.clone()
    topk = StandardTopKOutput(*routing(M, case.E, top_k, str(case.w1.device)))
    runner = MoeRunnerConfig(num_experts=case.E, num_local_experts=case.E, top_k=top_k,
                             inplace=True)
    f = case.flags
    block = list(f.block_shape) if f.block_shape is not None else None

    def call() -> None:
        x.copy_(x0)
        fused_moe(x, case.w1, case.w2, topk, moe_runner_config=runner,
                  use_fp8_w8a8=f.use_fp8_w8a8, use_int8_w8a8=f.use_int8_w8a8,
                  per_channel_quant=f.per_channel_quant, w1_scale=case.w1_scale,
                  w2_scale=case.w2_scale, block_shape=block)

    ctx = override_config(config) if config is not None else _null()
    try:
        with ctx:
            return _bench(call, reps, graph)
    except Exception:  # noqa: BLE001 - a failing candidate is simply not chosen
        if config is None:  # SGLang's own choice must run: show why it did not
            import traceback

            traceback.print_exc()
        return float("inf")


def sglang_choice(case: MoeCase, M: int, top_k: int) -> dict | None:
    """The configuration SGLang itself picks for ``case`` at ``M`` (its shipped file or its
    heuristic), as a plain dict of the kernel's tile keys; None if it cannot be read."""
    try:
        from sglang.srt.layers.moe.moe_runner.triton_utils import try_get_optimal_moe_config
        from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config import (
            get_config_dtype_str,
        )

        f = case.flags
        dtype = get_config_dtype_str(torch.bfloat16, use_fp8_w8a8=f.use_fp8_w8a8,
                                     use_int8_w8a8=f.use_int8_w8a8)
        cfg = try_get_optimal_moe_config(
            tuple(case.w1.shape), tuple(case.w2.shape), top_k, dtype, M,
            block_shape=list(f.block_shape) if f.block_shape else None,
            per_channel_quant=f.per_channel_quant)
    except Exception:  # noqa: BLE001 - only an extra candidate
        return None
    cfg = cfg[0] if isinstance(cfg, tuple) else cfg
    keys = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps",
            "num_stages")
    return {k: cfg[k] for k in keys if k in cfg}


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class _GpuLock:
    """Serialise the timed part across tuner processes (compiles overlap, timings do not)."""

    path = "/tmp/megatron_qrl_moe_tune.lock"

    def __enter__(self) -> None:
        import fcntl

        self.f = open(self.path, "w")  # noqa: SIM115 - closed in __exit__
        fcntl.flock(self.f, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        self.f.close()


def _bench(call: Callable[[], None], reps: int, graph: bool) -> float:
    call()  # compile + warm up, outside the lock
    torch.cuda.synchronize()
    with _GpuLock():
        return _timed(call, reps, graph)


def _timed(call: Callable[[], None], reps: int, graph: bool) -> float:
    run = call
    if graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            call()
            with torch.cuda.graph(g, stream=s):
                for _ in range(10):
                    call()
        torch.cuda.current_stream().wait_stream(s)
        run, reps = g.replay, max(1, reps // 10)
        per = 10
    else:
        per = 1
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / (reps * per)


def tune(case: MoeCase, ms: Sequence[int], top_k: int, *, log: Callable[[str], None] = print,
         keep: int = 2, budget_s: float = float("inf")
         ) -> tuple[dict[int, dict], dict[int, dict[str, float]]]:
    """Two-stage search; returns ``(best config per M, {M: {"default_us", "tuned_us"}})``.

    Stops searching after ``budget_s`` seconds and keeps the best found so far.
    """
    t0 = time.time()
    graph = time_config(case, ms[0], top_k, None) != float("inf")
    if not graph:
        log(f"[tune {case.name}] CUDA-graph timing failed; timing eagerly")
        if time_config(case, ms[0], top_k, None, graph=False) == float("inf"):
            raise RuntimeError(f"SGLang's fused MoE fails for {case.name} even with its own "
                               "config; nothing to tune")
    s1 = stage1_space(case.flags)
    timings: dict[int, list[tuple[float, dict]]] = {m: [] for m in ms}
    for i, cfg in enumerate(s1):
        if time.time() - t0 > budget_s:
            log(f"[tune {case.name}] budget reached in stage 1 after {i} configs")
            break
        for m in ms:
            timings[m].append((time_config(case, m, top_k, cfg, graph=graph), cfg))
        if i % 8 == 7:
            log(f"[tune {case.name}] stage 1 {i + 1}/{len(s1)} ({time.time() - t0:.0f} s)")
    tiles = [c for cs in best_per_m(timings, keep).values() for c in cs]
    s2 = stage2_space(tiles)
    for i, cfg in enumerate(s2):
        if time.time() - t0 > budget_s:
            log(f"[tune {case.name}] budget reached in stage 2 after {i} configs")
            break
        for m in ms:
            timings[m].append((time_config(case, m, top_k, cfg, graph=graph), cfg))
        if i % 16 == 15:
            log(f"[tune {case.name}] stage 2 {i + 1}/{len(s2)} ({time.time() - t0:.0f} s)")
    summary = {}
    for m in ms:  # SGLang's own choice competes too: a shipped file never gets slower
        default = time_config(case, m, top_k, None, graph=graph)
        tuned = min((t for t, _ in timings[m]), default=float("inf"))
        summary[m] = {"default_us": round(default, 2), "tuned_us": round(tuned, 2)}
        own = sglang_choice(case, m, top_k)
        if own is not None:
            timings[m].append((default, own))
    best = {m: min(ts, key=lambda tc: tc[0])[1] for m, ts in timings.items()
            if ts and min(t for t, _ in ts) < float("inf")}
    if not best:
        raise RuntimeError(f"every candidate failed for {case.name}; nothing to write")
    log(f"[tune {case.name}] done in {time.time() - t0:.0f} s: {len(s1)} + {len(s2)} configs")
    return best, summary
