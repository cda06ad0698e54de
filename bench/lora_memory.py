#!/usr/bin/env python3
"""Trainer memory of full RL vs LoRA vs QLoRA-NF4 vs a rollout-format base (Qwen3-4B shape).

    python bench/lora_memory.py --layers 36 --out bench/results/lora_memory.jsonl    # H200
    python bench/lora_memory.py --layers 1                                           # CPU

Each variant is the qrl-train model (``rl.trainer.build_policy`` with the ``ForwardPlan`` of
``--qrl-lora-*``, megatron DDP + Adam, BF16 parameters with fp32 masters): full RL trains every
parameter; LoRA variants freeze the base into ``--qrl-lora-base-format`` (bf16 / nf4 / nvfp4 /
w4a16 / fp8 / int8) with r=32 adapters on q/k/v/o/gate/up/down, then build the RL optimizer
(adapters only), as the driver does at the RL start. Printed per variant: bytes of the frozen
linear bases, of the trainable parameters, of the Adam state (exp_avg, exp_avg_sq and fp32
masters), and on a GPU ``torch.cuda.max_memory_allocated`` over one forward/backward/step at
``--micro-batch`` x ``--seq-len`` (reset before each variant; one variant resident at a time).
The LoRA models are frozen before megatron DDP wraps them, as a run without warm-up
(``--qrl-sft-steps 0``) is; a run with a warm-up keeps the base's DDP gradient buffer (docs/LORA.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 9728,
    "max_position_embeddings": 40960, "num_attention_heads": 32, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "vocab_size": 151936, "torch_dtype": "bfloat16",
}
VARIANTS = ("full", "lora:bf16", "lora:nf4", "lora:nvfp4", "lora:w4a16", "lora:fp8", "lora:int8")


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def measure(variant: str, arch, rank: int, micro_batch: int, seq_len: int) -> dict:
    import torch

    from megatron_qrl.models.lora import lora_linears
    from megatron_qrl.models.lora_base import storage_bytes
    from megatron_qrl.models.lora_config import LoraConfig
    from megatron_qrl.rl.forward import ForwardPlan, _lora_plan
    from megatron_qrl.rl.lora_sync import enter_lora
    from megatron_qrl.rl.trainer import PolicyTrainer, build_policy

    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    configs = None
    if variant == "full":
        plan = ForwardPlan()
    else:
        from megatron_qrl.config import QrlConfigs
        from megatron_qrl.config.run import RoutingReplayConfig, TrainForwardConfig

        fmt = variant.split(":")[1]
        lora = LoraConfig(rank=rank, alpha=float(rank), base_format=fmt)

        class _R:  # the rollout config fields _lora_plan reads
            format = "bf16"

        class _Run:  # no warm-up: the base is frozen before DDP (adapter gradient buffers only)
            sft_steps = 0

        configs = QrlConfigs(lora=lora, train=TrainForwardConfig(),
                             routing=RoutingReplayConfig(), rollout=_R(), run=_Run())
        plan = _lora_plan(configs, arch)
    policy = build_policy(arch, 1e-5, plan, bf16=gpu)
    trainer = PolicyTrainer(policy)
    if configs is not None:
        enter_lora(trainer, configs)
        policy.set_optimizer(policy.new_optimizer(1e-5))
    module = trainer.module
    base = storage_bytes(module) if configs is not None else _bytes(
        lin.weight for _, lin in lora_linears(module)) or _bytes(
        p for n, p in module.named_parameters() if "linear_" in n)
    trainable = _bytes(p for p in module.parameters() if p.requires_grad)
    out = {"variant": variant, "layers": arch.num_layers, "base_linear_bytes": base,
           "trainable_bytes": trainable}
    if gpu:
        dev = torch.cuda.current_device()
        x = torch.randint(0, arch.vocab_size, (micro_batch, seq_len), device=dev)
        pos = torch.arange(seq_len, device=dev)[None].expand_as(x)
        policy.ddp.zero_grad_buffer()
        policy.optimizer.zero_grad()
        module(x, pos, None).float().logsumexp(-1).mean().backward()
        policy.optimizer.step()
        torch.cuda.synchronize()
        out["peak_bytes"] = torch.cuda.max_memory_allocated()
    del trainer, policy, module
    gc.collect()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from megatron_qrl.models.hf_config import arch_from_dict
    from megatron_qrl.models.runtime import single_process_megatron

    arch = arch_from_dict({**QWEN3_4B, "num_hidden_layers": args.layers})
    rows = []
    with single_process_megatron():
        for v in args.variants.split(","):
            row = measure(v, arch, args.rank, args.micro_batch, args.seq_len)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| variant | frozen linear base (MiB) | trainable (MiB) | peak GPU (GiB) |\n|---|---|---|---|")
    for r in rows:
        peak = f"{r['peak_bytes'] / 2**30:.2f}" if "peak_bytes" in r else "-"
        print(f"| {r['variant']} | {r['base_linear_bytes'] / 2**20:.1f} | "
              f"{r['trainable_bytes'] / 2**20:.1f} | {peak} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
