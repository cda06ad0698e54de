#!/usr/bin/env python3
"""Tune SGLang's Triton fused-MoE kernel for a Qwen3-MoE shape and ship the configs.

    python tools/tune_fused_moe.py --formats fp8_block,fp8,int8 \
        --experts 128 --moe-intermediate 768 --hidden 2048 --top-k 8 \
        --summary bench/results/moe_tune.json

Needs a CUDA GPU and SGLang (the H200 recipe). Writes one SGLang-named JSON per format into
megatron_qrl/rollout_sglang/kernels/configs/triton_<version>/ (picked up by SGLangEngine via
SGLANG_MOE_CONFIG_DIR, see megatron_qrl.rollout_sglang.kernels.moe_configs) and a summary with the
kernel time of SGLang's own choice vs the tuned one per token count, measured in this run.
Defaults: Qwen3-30B-A3B at TP=1 (E=128, N=768, K=2048, top-8).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_qrl.rollout_sglang.kernels.moe_configs import SHIPPED, write_config  # noqa: E402
from megatron_qrl.rollout_sglang.kernels.moe_tune import DEFAULT_M, TUNE_FORMATS, make_case, tune  # noqa: E402
from megatron_qrl.utils.cli import positive_float, positive_int, tool_parser  # noqa: E402


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = tool_parser(__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="fp8_block,fp8,int8",
                   help=f"comma list of {sorted(TUNE_FORMATS)}")
    p.add_argument("--experts", type=positive_int, default=128)
    p.add_argument("--moe-intermediate", type=positive_int, default=768,
                   help="moe_intermediate_size per TP rank (N)")
    p.add_argument("--hidden", type=positive_int, default=2048)
    p.add_argument("--top-k", type=positive_int, default=8)
    p.add_argument("--m", default=",".join(map(str, DEFAULT_M)), help="token counts to tune")
    p.add_argument("--out", type=Path, default=SHIPPED, help="config root (default: shipped)")
    p.add_argument("--summary", type=Path, default=None, help="write a JSON summary here")
    p.add_argument("--budget-s", type=positive_float, default=float("inf"),
                   help="stop searching a format after this many seconds (keep the best so far)")
    a = p.parse_args(argv)
    try:
        a.m = [positive_int(m) for m in a.m.split(",")]
    except argparse.ArgumentTypeError as exc:
        p.error(f"--m {a.m}: token counts {exc}")
    bad = [f for f in a.formats.split(",") if f not in TUNE_FORMATS]
    if bad:
        p.error(f"--formats {','.join(bad)}: not a Triton fused-MoE format; choose from "
                f"{sorted(TUNE_FORMATS)} (w4a16/nvfp4 run Marlin kernels)")
    return a


def _init_sglang(hf_config: dict) -> None:
    """SGLang's MoE code reads its process-wide config and TP group: publish defaults for a
    local config-only model directory (nothing is downloaded), TP=1."""
    import torch
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    from megatron_qrl.compat.distributed import free_port

    if not torch.cuda.is_available():
        raise SystemExit("tune_fused_moe: needs a CUDA GPU (and SGLang); none is visible")
    from megatron_qrl.rollout_sglang.launch import write_engine_dir

    model_dir = write_engine_dir(hf_config, "bf16")
    publish(ServerArgs(model_path=str(model_dir), load_format="dummy",
                       skip_tokenizer_init=True), role="test")
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="nccl",
                                 distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
    initialize_model_parallel(tensor_model_parallel_size=1)


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    import torch
    import triton
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config import (
        get_config_dtype_str,
        get_config_file_name,
    )

    _init_sglang({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                  "hidden_size": a.hidden, "num_experts": a.experts,
                  "num_experts_per_tok": a.top_k, "moe_intermediate_size": a.moe_intermediate,
                  "num_hidden_layers": 1, "num_attention_heads": 16, "num_key_value_heads": 4,
                  "head_dim": 128, "vocab_size": 1024, "intermediate_size": 4 * a.hidden,
                  "max_position_embeddings": 4096, "rms_norm_eps": 1e-6})
    ms = a.m
    summary = {"device": torch.cuda.get_device_name(), "triton": triton.__version__,
               "E": a.experts, "N": a.moe_intermediate, "K": a.hidden, "top_k": a.top_k,
               "formats": {}}
    for fmt in a.formats.split(","):
        case = make_case(fmt, a.experts, a.moe_intermediate, a.hidden)
        f = case.flags
        dtype = get_config_dtype_str(torch.bfloat16, use_fp8_w8a8=f.use_fp8_w8a8,
                                     use_int8_w8a8=f.use_int8_w8a8)
        name = get_config_file_name(a.experts, a.moe_intermediate, dtype,
                                    list(f.block_shape) if f.block_shape else None,
                                    f.per_channel_quant)
        best, times = tune(case, ms, a.top_k, log=lambda s: print(s, flush=True),
                           budget_s=a.budget_s)
        path = write_config(triton.__version__, name, best, a.out)
        print(f"[tune {fmt}] wrote {path}", flush=True)
        for m in ms:
            t = times[m]
            if m not in best:
                continue
            print(f"[tune {fmt}] M={m:5d} sglang {t['default_us']:9.1f} us  tuned "
                  f"{t['tuned_us']:9.1f} us  x{t['default_us'] / t['tuned_us']:.2f}", flush=True)
        summary["formats"][fmt] = {"file": name, "us": {str(m): times[m] for m in ms}}
        del case
        torch.cuda.empty_cache()
    if a.summary:
        a.summary.parent.mkdir(parents=True, exist_ok=True)
        tmp = a.summary.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=1))
        os.replace(tmp, a.summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
