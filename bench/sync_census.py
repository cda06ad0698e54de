#!/usr/bin/env python3
"""Op census of the direct weight sync's trainer side on the CPU: what it does per weight.

    python bench/sync_census.py --formats fp8,fp8_block,int8 --layers 2 --experts 16 \
        --out bench/results/sync_census.jsonl      # ~2 min per format
    python bench/sync_census.py --tiny --layers 1 --experts 2   # a smoke run, seconds

The direct sync (``SGLangOptions(sync="direct")``) writes into the engine's own tensors. Here
the engine's storage is built on the CPU in SGLang's layout for the Qwen3-30B-A3B shape of
bench/weight_sync.py (cut to ``--layers`` / ``--experts``: fused ``qkv_proj``, stacked
``w13_*`` / ``w2_*`` experts, their scales, norms, embeddings; :func:`engine_storage`), and
the trainer's BF16 stream (:func:`bench.weight_sync.trainer_stream`, experts as rows of one
stacked tensor per kind, as a stacked-experts trainer streams them) is written into it by
the writer (``rollout_sglang.sync.writer``) three ways, each under
:class:`megatron_qrl.utils.op_census.OpCensus`:

- ``direct``: the weights quantized straight into the engine's regions
  (``writer_stream`` -> ``QuantSpec.quantize_into``), what ``sync="direct"`` runs;
- ``direct+packed``: the packed stream (``pack_state_dict(stack_experts=True)``) copied
  into the regions (the direct sync before it quantized in place);
- ``direct+qcache``: the aligned forward's Q(W) cache (made before the census) copied as it
  is, no quantization in the sync.

Per variant, two syncs into fresh storage (``write``: quantize / copy into the regions, no
fingerprints; ``sync``: the same with the fingerprints of what was written, as the direct
sync takes them — their torch code on the CPU, a Triton kernel on a GPU): aten ops (``write``
also per quantized weight or expert stack), host syncs (the trainer's and the engine's
tensors count as device tensors), and the bytes of tensors the ops made with storage of their
own (temporaries, packed copies; not the engine's regions written in place), with the
largest one; the write phase's ratios to ``direct+packed`` from the same run. Every variant
must leave the engine's tensors bit-identical (checked: ``engine_sha``). Counts, not speed:
the CPU says nothing about the H200's seconds (bench/weight_sync.py ``FMT:direct`` there).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._runner import append_records, commit  # noqa: E402
from bench.weight_sync import _qcache, model_config, trainer_stream  # noqa: E402

VARIANTS = ("direct", "direct+packed", "direct+qcache")


def engine_storage(cfg: dict, spec, device: str = "cpu") -> tuple:
    """``(EngineLayout, tensors)`` of an SGLang engine holding ``cfg`` in ``spec``'s direct
    layout (what its storage service exports, :func:`~megatron_qrl.rollout_sglang.sync.loader.
    storage.describe`), zero-filled on ``device``."""
    from megatron_qrl.sync.protocol.engine_layout import EngineLayout, ParamLayout
    from megatron_qrl.sync.protocol.wire import dtype_name

    h, d, e, f = (cfg["hidden_size"], cfg["head_dim"], cfg["num_experts"],
                  cfg["moe_intermediate_size"])
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    codes, leaf = getattr(torch, spec.weight_format), spec._packed_suffixes()[1]
    unit = spec.block[0] if spec.block else 1
    params: dict[str, ParamLayout] = {}
    tensors: dict[str, torch.Tensor] = {}

    def add(name, shape, dtype, experts=False, shards=None):
        tensors[name] = torch.zeros(shape, dtype=dtype, device=device)
        params[name] = ParamLayout(tuple(shape), dtype_name(dtype), False, experts, shards or {})

    def linear(mod, out, k, members=None):
        rows = {m: (s, s + n) for m, s, n in members} if members else None
        add(f"{mod}.weight", (out, k), codes, shards=rows)
        blocks = {m: (a // unit, -(-b // unit)) for m, (a, b) in rows.items()} if rows else None
        add(f"{mod}.{leaf}", spec._scale_shape(out, k), torch.float32, shards=blocks)

    bf16 = torch.bfloat16
    add("model.embed_tokens.weight", (cfg["vocab_size"], h), bf16)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        linear(f"{p}self_attn.qkv_proj", q + 2 * kv, h,
               [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)])
        linear(f"{p}self_attn.o_proj", h, q)
        for n, size in (("input_layernorm", h), ("post_attention_layernorm", h),
                        ("self_attn.q_norm", d), ("self_attn.k_norm", d)):
            add(f"{p}{n}.weight", (size,), bf16)
        add(f"{p}mlp.gate.weight", (e, h), bf16)
        x = f"{p}mlp.experts."
        halves = {"gate_proj": (0, f), "up_proj": (f, 2 * f)}
        add(f"{x}w13_weight", (e, 2 * f, h), codes, True, halves)
        add(f"{x}w2_weight", (e, h, f), codes, True)
        add(f"{x}w13_{leaf}", (e, *spec._scale_shape(2 * f, h)), torch.float32, True,
            {m: (a // unit, b // unit) for m, (a, b) in halves.items()})
        add(f"{x}w2_{leaf}", (e, *spec._scale_shape(h, f)), torch.float32, True)
    add("model.norm.weight", (h,), bf16)
    add("lm_head.weight", (cfg["vocab_size"], h), bf16)
    return EngineLayout(params, "cpu"), tensors


class FreshBytes(TorchDispatchMode):
    """Bytes of the tensors aten ops create with storage of their own (not a view of, nor
    written into, an input) and the largest of them."""

    def __init__(self):
        super().__init__()
        self.bytes = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                n = t.numel() * t.element_size()
                self.bytes += n
                self.largest = max(self.largest, n)
        return out


class NoSums:
    """A writer's fingerprints, not taken (the ``write`` phase counts the writes alone)."""

    def add(self, name, t, kept=False):
        pass

    def add_rows(self, names, t, kept=False):
        pass

    def flush(self):
        pass


def census(fmt: str, variant: str, cfg: dict) -> dict:
    """Two syncs of ``variant``, each into a fresh engine storage, counted: ``write`` (quantize
    / copy into the regions, no fingerprints) and ``sync`` (the same with the fingerprints of
    what was written, as the direct sync takes them) (module docstring)."""
    from megatron_qrl.quant import get_spec
    from megatron_qrl.quant.pack_stream import writer_stream
    from megatron_qrl.rollout_sglang.sync.writer import writer_for
    from megatron_qrl.sync.protocol.checksums import Checksums
    from megatron_qrl.utils.op_census import OpCensus

    spec = get_spec(fmt)
    quantized = _qcache(spec, cfg, "cpu") if variant == "direct+qcache" else None
    source = list(trainer_stream(cfg, "cpu"))  # the trainer's weights, made before counting
    row = {"format": fmt, "variant": variant, "layers": cfg["num_hidden_layers"],
           "experts": cfg["num_experts"]}
    for phase, sums in (("write", NoSums()), ("sync", Checksums(batch_host=True))):
        layout, tensors = engine_storage(cfg, spec)
        c, fresh = OpCensus(), FreshBytes()
        c.mark_device(list(tensors.values()) + [t for _, t in source])
        stream = (spec.pack_state_dict(iter(source), stack_experts=True)
                  if variant == "direct+packed" else
                  writer_stream(spec, iter(source), quantized=quantized))
        writer = writer_for(spec, layout, tensors, sums)
        with torch.no_grad(), c.phase(phase), fresh:
            writer.write_all(stream)
            if phase == "sync":
                row["fingerprints"] = len(sums.result())
        row |= {f"{phase}_ops": c.total_ops(phase), f"{phase}_syncs": len(c.syncs(phase)),
                f"{phase}_fresh_mb": round(fresh.bytes / 2**20, 1),
                f"{phase}_largest_mb": round(fresh.largest / 2**20, 2)}
    weights = sum(1 for n in writer.shapes  # quantized weights or expert stacks
                  if n.endswith(".weight") and tensors_dtype(layout, n) == spec.weight_format)
    sha = hashlib.sha256()
    for name in sorted(tensors):
        sha.update(tensors[name].reshape(-1).view(torch.uint8).numpy().tobytes())
    return row | {"quantized": writer.quantized, "copied": writer.copied, "weights": weights,
                  "write_ops_per_weight": round(row["write_ops"] / weights, 1),
                  "engine_sha": sha.hexdigest()[:16]}


def tensors_dtype(layout, packed_name: str) -> str:
    """The engine dtype of the parameter packed tensor ``packed_name`` lands in."""
    from megatron_qrl.sync.protocol.engine_layout import locate

    return layout.params[locate(layout, packed_name).param].dtype


COLUMNS = ("write_ops", "write_ops_per_weight", "write_syncs", "write_fresh_mb",
           "write_largest_mb", "sync_ops", "sync_syncs", "sync_fresh_mb")


def table(rows: list[dict]) -> str:
    """Markdown: each variant's counts, and its write phase's ratios to ``direct+packed`` of
    the same format (same run)."""
    base = {r["format"]: r for r in rows if r["variant"] == "direct+packed"}
    lines = ["| format | variant | " + " | ".join(COLUMNS) + " | write ops vs packed | "
             "write fresh vs packed | engine bytes |", "|---|---|" + "---|" * (len(COLUMNS) + 3)]
    for r in rows:
        b = base.get(r["format"])
        same = "same" if b is None or b["engine_sha"] == r["engine_sha"] else "DIFFER"

        def ratio(k, r=r, b=b):
            return f"{r[k] / b[k]:.2f}x" if b and b[k] else ""

        lines.append(f"| {r['format']} | {r['variant']} | " + " | ".join(str(r[k]) for k in COLUMNS)
                     + f" | {ratio('write_ops')} | {ratio('write_fresh_mb')} | {same} |")
    return "\n".join(lines)


def tiny_config(layers: int, experts: int) -> dict:
    """The 30B-A3B config at small widths (``--tiny``: a smoke run, the tests): hidden 256,
    4 / 1 heads of 128, experts 256 wide, vocabulary 1024."""
    return model_config(layers, experts) | {
        "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1,
        "moe_intermediate_size": 256, "vocab_size": 1024}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="fp8,fp8_block,int8")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--tiny", action="store_true",
                   help="small widths (hidden 256, vocabulary 1024): a smoke run")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    bad = set(a.variants.split(",")) - set(VARIANTS)
    if bad:
        p.error(f"--variants {sorted(bad)}: choose from {', '.join(VARIANTS)}")
    torch.set_num_threads(1)
    cfg = (tiny_config if a.tiny else model_config)(a.layers, a.experts)
    head = {"commit": commit(), "device": "cpu", "tiny": a.tiny}
    rows = [head | census(f, v, cfg) for f in a.formats.split(",") for v in a.variants.split(",")]
    append_records(a.out, rows)
    print(f"commit {head['commit']}, CPU op census (counts, not speed)\n{table(rows)}")
    return 0 if all(r["engine_sha"] == rows[i - i % len(a.variants.split(","))]["engine_sha"]
                    for i, r in enumerate(rows)) else 1


if __name__ == "__main__":
    sys.exit(main())
