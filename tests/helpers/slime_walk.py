"""The QRL=1 slime example walked on CPU through slime 0.3.1's own trainer-side code.

Run as ``python -m tests.helpers.slime_walk DIR LOSS`` in a subprocess whose PYTHONPATH puts
Megatron-LM 1dcf0da (megatron.core 0.16.0rc0 + megatron.training, slime's patches:
``tools/slime_cpu_site.sh --stage-megatron-core``) before the slime CPU site; prints one
``SLIME_WALK {json}`` line. The steps are the ones slime's trainer actor takes:

1. the argument list is the one ``examples/slime/run_qwen3_4b_qrl_1gpu.sh`` runs (captured by
   running the script with ``python3`` / ``ray`` stand-ins on PATH), model flags overridden for a
   tiny Qwen3 checkpoint (``tools/make_random_checkpoint.py`` + its fp8_block export), parsed by
   the launcher (slime's ``parse_args`` + ``add_qrl_args``, hooks filled, options validated);
2. ``--custom-megatron-init-path`` (slime's ``initialize.init`` calls it before the model), then
   slime's ``model_provider`` with ``--spec ... qrl_layer_spec`` on Megatron's TE spec tree
   (CPU provider: TE does not import here) in megatron's ``Float16Module``, loaded from
   ``--load`` (an HF directory, as in the example) by slime's own ``hf_to_megatron`` loader;
3. slime's log-prob forward against the rollout's reference forward on the fp8_block export,
   and the before-log-prob hook's timing (:mod:`tests.helpers.slime_walk_logprobs`); the
   before-log-prob / before-train-step hooks, one forward on packed samples and slime's
   ``loss_function`` (custom loss) with a backward;
4. slime's weight sync conversion: ``named_params_and_buffers`` + ``all_gather_param`` +
   ``convert_to_hf`` with the rollout checkpoint's ``quantization_config`` (our quantizer is
   installed by the init hook), compared with the fp8_block export SGLang starts from;
5. the error-token post-process and slime's ``log_rollout_data`` on its output.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "slime" / "run_qwen3_4b_qrl_1gpu.sh"
TINY_QWEN3 = {"hidden_size": 256, "intermediate_size": 384, "head_dim": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
              "tie_word_embeddings": True}
"""Qwen3-4B's structure (tied embeddings, q/k norms, grouped-query attention: Megatron's fused
qkv interleaves the groups) at fp8_block's smallest block-aligned size."""
TINY_FLAGS = ["--num-layers", "2", "--hidden-size", "256", "--ffn-hidden-size", "384",
              "--num-attention-heads", "4", "--num-query-groups", "2", "--vocab-size", "256"]
CPU_FLAGS = {"apply_rope_fusion": False, "no_persist_layer_norm": True,
             "use_cpu_initialization": True}
"""What differs on a CPU only: TE's RoPE fusion and apex's persistent norm are GPU kernels."""


def checkpoints(workdir: Path) -> Path:
    """A tiny random Qwen3 HF checkpoint (BF16, tokenizer, prompts) and its fp8_block export."""
    sys.path.insert(0, str(REPO / "tools"))
    from export_quantized import main as export_main
    from make_random_checkpoint import make_random_checkpoint

    base = json.loads((REPO / "megatron_qrl/data/configs/tiny_qwen3.json").read_text())
    cfg = workdir / "tiny_qwen3_4b_like.json"
    cfg.write_text(json.dumps({**base, **TINY_QWEN3}))
    ckpt = Path(make_random_checkpoint(str(cfg), workdir / "ckpt", layers=2, prompts=16))
    export_main(["--hf-dir", str(ckpt), "--format", "fp8_block", "--out", f"{ckpt}-fp8_block"])
    return ckpt


def run_example(workdir: Path, base: dict[str, str] | None = None, **env: str
                ) -> tuple[list[str], dict[str, str]]:
    """The example script run with ``python3`` / ``ray`` stood in: the arguments its ``python3``
    got and the environment it ran in (``base``, default ours, plus ``env``: CKPT, QRL, ...)."""
    fake = workdir / "bin"
    fake.mkdir(exist_ok=True)
    argv_out, env_out = workdir / "argv", workdir / "env"
    (fake / "python3").write_text('#!/bin/bash\n[ "$1" = -c ] && exit 1\n'
                                  f'printf "%s\\0" "$@" > {argv_out}\nenv -0 > {env_out}\n')
    (fake / "ray").write_text("#!/bin/bash\nexit 0\n")
    for f in fake.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    base = dict(os.environ if base is None else base)
    full = dict(base, PATH=f"{fake}:{base['PATH']}", SLIME_DIR=str(workdir), **env)
    subprocess.run(["bash", str(EXAMPLE)], env=full, check=True, capture_output=True)
    ran = dict(line.split("=", 1) for line in env_out.read_text().split("\0") if "=" in line)
    return argv_out.read_bytes().decode().split("\0")[:-1], ran


def example_argv(workdir: Path, ckpt: Path, loss: str) -> list[str]:
    """The slime flags the example passes with QRL=1, the model flags made tiny."""
    argv, _ = run_example(workdir, CKPT=str(ckpt), LOSS=loss, QRL="1")
    assert argv[:2] == ["-m", "megatron_qrl.integrations.slime.launch"], argv[:2]
    return argv[2:] + TINY_FLAGS


def build_model(args: Any) -> Any:
    """slime's ``model_provider`` (``--spec`` = ours) in megatron's Float16Module, loaded by
    slime's own HF loader from ``--load`` (an HF directory, as in the example)."""
    from megatron.core.tensor_parallel import (
        set_defaults_if_not_set_tensor_model_parallel_attributes,
    )
    from megatron.core.transformer.module import Float16Module
    from slime.backends.megatron_utils.hf_to_megatron import load_hf_weights
    from slime.backends.megatron_utils.model_provider import _get_model_provider_func

    from tests.helpers.te_spec_cpu import te_spec_on_cpu

    with te_spec_on_cpu():
        model = _get_model_provider_func(args)(pre_process=True, post_process=True)
    for p in model.parameters():  # megatron.training's get_model does this
        set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    model = Float16Module(model.config, model)
    load_hf_weights(args, [model], args.load)
    return model


def packed_batch() -> tuple[Any, dict[str, Any]]:
    """Two samples in slime's micro-batch layout (CP = 1) and their token ids [1, T]."""
    import torch

    g = torch.Generator().manual_seed(0)
    prompts, resps = (3, 5), (4, 6)
    totals = [p + r for p, r in zip(prompts, resps)]
    tokens = [torch.randint(0, 128, (t,), generator=g) for t in totals]
    batch = {"unconcat_tokens": tokens, "tokens": tokens, "total_lengths": totals,
             "response_lengths": list(resps),
             "loss_masks": [torch.ones(r, dtype=torch.int) for r in resps],
             "advantages": [torch.full((r,), 0.5) for r in resps],
             "log_probs": [torch.randn(r, generator=g) * 0.1 - 3 for r in resps],
             "rollout_log_probs": [torch.randn(r, generator=g) * 0.1 - 3 for r in resps],
             "rollout_mask_sums": torch.tensor([float(r) for r in resps]),
             "global_batch_sizes": [len(resps)]}
    return torch.cat(tokens)[None], batch


def train_step(args: Any, model: Any) -> dict[str, Any]:
    """The hooks, one forward and slime's ``loss_function`` + backward."""
    import torch
    from slime.backends.megatron_utils.loss import loss_function

    from megatron_qrl.integrations.slime.hooks import qrl_before_log_prob, qrl_before_train_step
    from megatron_qrl.integrations.slime.model import aligned_states

    qrl_before_log_prob(args, [model], "")
    qrl_before_train_step(args, 0, 0, [model], None, None)
    ids, batch = packed_batch()
    pos = torch.cat([torch.arange(t) for t in batch["total_lengths"]])[None]
    logits = model(ids, pos, attention_mask=None)
    loss, _, log = loss_function(args, batch, 1, len(batch["total_lengths"]), logits)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return {"loss": float(loss), "metrics": log["keys"], "grad_params": len(grads),
            "grad_finite": all(bool(torch.isfinite(g).all()) for g in grads),
            "aligned_states": len(aligned_states([model])),
            "aligned_linears": sorted({type(m).__name__ for m in model.modules()
                                       if getattr(m, "qrl_state", None) is not None})}


def _bits(t: Any) -> Any:
    import torch

    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def weight_sync(args: Any, model: Any) -> dict[str, Any]:
    """slime's conversion of every parameter as its weight update runs it, against the export."""
    import torch
    from safetensors.torch import load_file
    from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf
    from slime.backends.megatron_utils.update_weight.common import (
        all_gather_param,
        named_params_and_buffers,
    )
    from transformers import AutoConfig

    from megatron_qrl.integrations.slime.quantizer import installed_quantizer

    hf_config = AutoConfig.from_pretrained(args.hf_checkpoint)  # what slime's actor reads
    qc = getattr(hf_config, "quantization_config", None)
    sent: dict[str, Any] = {}
    with torch.no_grad():
        for name, param in named_params_and_buffers(args, [model], convert_to_global_name=True):
            full = all_gather_param(name, param)
            for hf_name, t in convert_to_hf(args, type(hf_config).__name__.lower(), name, full, qc):
                sent[hf_name] = t
    export = load_file(f"{args.hf_checkpoint}/model.safetensors")
    common = set(sent) & set(export)
    return {"quantization_config": qc, "missing": sorted(set(export) - set(sent)),
            "extra": sorted(set(sent) - set(export)),
            "layout_differs": sorted(k for k in common if (sent[k].shape, sent[k].dtype)
                                     != (export[k].shape, export[k].dtype)),
            "value_differs": sorted(k for k in common if sent[k].shape == export[k].shape
                                    and not torch.equal(_bits(sent[k]), _bits(export[k]))),
            "fp8_tensors": sum(t.dtype == torch.float8_e4m3fn for t in sent.values()),
            "aqn_step": installed_quantizer().step}


def postprocess() -> dict[str, Any]:
    """The error-token post-process on slime's rollout data, then slime's own rollout logging."""
    from slime.observability.train_metric_utils import log_rollout_data

    from megatron_qrl.integrations.slime.postprocess import qrl_rollout_data_postprocess

    _, data = packed_batch()
    data.pop("unconcat_tokens")
    data["log_probs"][1][2] = -30.0  # improbable under the trainer: an error token
    qrl_rollout_data_postprocess(ARGS, 0, data)
    log_rollout_data(0, ARGS, data)
    return {"loss_masks": [m.tolist() for m in data["loss_masks"]],
            "rates": sorted(k for k in data if k.startswith("qrl_error_"))}


ARGS: Any = None


def walk(workdir: Path, loss: str) -> dict[str, Any]:
    """Steps 1-5 of the module docstring; a summary of what each produced."""
    global ARGS
    import megatron.core
    import torch

    from megatron_qrl.integrations.slime.hooks import qrl_megatron_init
    from megatron_qrl.integrations.slime.launch import parse
    from megatron_qrl.models.runtime import single_process_megatron
    from tests.helpers.slime_walk_logprobs import fp32_alignment, hook_timing, logprob_alignment

    ckpt = checkpoints(workdir)
    ARGS = args = parse(example_argv(workdir, ckpt, loss))
    for key, value in CPU_FLAGS.items():
        setattr(args, key, value)
    out: dict[str, Any] = {"megatron_core": megatron.core.__version__, "loss_kind":
                           args.qrl_loss_kind, "spec": args.spec, "params_dtype":
                           str(args.params_dtype), "hf_checkpoint": args.hf_checkpoint}
    with single_process_megatron():
        qrl_megatron_init(args)
        model = build_model(args)
        out["model_dtype"] = str(next(model.parameters()).dtype)
        _, batch = packed_batch()
        out["logprobs"] = logprob_alignment(args, model, batch)
        out["hook_timing"] = hook_timing(args, model, batch)
        out.update(train_step(args, model))
        out["sync"] = weight_sync(args, model)
        out["postprocess"] = postprocess()
        out["logprobs_fp32"] = fp32_alignment(args, model, batch)
    assert torch.is_grad_enabled()
    return out


if __name__ == "__main__":
    result = walk(Path(sys.argv[1]), sys.argv[2])
    print("SLIME_WALK " + json.dumps(result, default=str), flush=True)
