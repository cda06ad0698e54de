"""The QRL=1 slime example (``examples/slime/run_qwen3_4b_qrl_1gpu.sh``) walked on CPU through
slime 0.3.1's trainer-side code against the Megatron-LM tree slime pins (1dcf0da, megatron.core
0.16.0rc0, slime's patches): the launcher's parse of the script's own flags, the init hook,
slime's model provider with ``--spec ... qrl_layer_spec``, the hooks, slime's loss_function with
our ACR / TBPO loss and a backward, slime's weight-sync conversion with our fp8_block packs
against the export SGLang starts from, and the error-token post-process with slime's rollout
logging (:mod:`tests.helpers.slime_walk`).

It runs in a subprocess over the slime CPU site (``bash tools/slime_cpu_site.sh``) with
Megatron-LM's tree first on the path: ``$QRL_MEGATRON_LM_TREE``, else
``shared/third_party/megatron-lm-1dcf0da-core`` above this checkout, as
``bash tools/slime_cpu_site.sh --stage-megatron-core DIR`` writes it. Without either it skips
with that reason: the site's megatron.training at 1dcf0da cannot build a TransformerConfig of
the 0.16.1 wheel (it sets fields 0.16.1 does not have), so slime's model provider needs the
tree's own megatron.core.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integrations.test_integrations_slime import SKIP, find_slime_src

pytestmark = [pytest.mark.skipif(SKIP is not None, reason=SKIP or ""), pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TREE_NAME = "megatron-lm-1dcf0da-core"


def megatron_tree() -> Path | None:
    """Megatron-LM 1dcf0da with megatron/core and megatron/training (patched), or None."""
    given = os.environ.get("QRL_MEGATRON_LM_TREE")
    candidates = ([Path(given)] if given else
                  [p / "shared" / "third_party" / TREE_NAME for p in (REPO, *REPO.parents)])
    return next((c for c in candidates if (c / "megatron/core/package_info.py").is_file()
                 and (c / "megatron/training/arguments.py").is_file()), None)


def run_walk(tmp_path: Path, loss: str) -> dict:
    from tests.helpers import slime_cli

    site, tree = slime_cli.cpu_site(), megatron_tree()
    if site is None:
        pytest.skip("slime's parse_args needs its CPU site: `bash tools/slime_cpu_site.sh`")
    if tree is None:
        pytest.skip("Megatron-LM 1dcf0da with megatron/core not found ($QRL_MEGATRON_LM_TREE or "
                    f"shared/third_party/{TREE_NAME}): `MEGATRON_GIT=... SLIME_GIT=... bash "
                    "tools/slime_cpu_site.sh --stage-megatron-core DIR`")
    path = os.pathsep.join([str(tree), str(site), str(REPO), str(find_slime_src())])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "tests.helpers.slime_walk", str(tmp_path), loss],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("SLIME_WALK ")]
    assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-5000:]
    got = json.loads(lines[-1].removeprefix("SLIME_WALK "))
    got["said"] = [ln for ln in run.stdout.splitlines() if ln.startswith("[megatron_qrl] ")]
    return got


@pytest.mark.parametrize("loss", ["acr", "tbpo"])
def test_qrl_example_walks_slimes_trainer_path(tmp_path, loss):
    from megatron_qrl.integrations.slime.options import SPEC

    got = run_walk(tmp_path, loss)
    assert got["megatron_core"] == "0.16.0rc0"  # the tree's, not the 0.16.1 wheel
    # the example's flags as parsed: fp8_block export for SGLang, bf16 trainer, our spec
    assert got["loss_kind"] == loss and got["spec"] == SPEC
    assert got["hf_checkpoint"].endswith("ckpt-fp8_block")
    assert got["params_dtype"] == got["model_dtype"] == "torch.bfloat16"
    # slime's provider built the aligned, TE-named linears and the hooks found their state
    assert got["aligned_states"] == 1
    assert got["aligned_linears"] == ["AlignedTELayerNormColumnParallelLinear",
                                      "AlignedTERowParallelLinear"]
    # what was installed, said once each in slime's log: by the init hook, and by the first
    # hook that saw the model (the hooks ran several times)
    init, model = [ln for ln in got["said"] if "rollout format" in ln], \
        [ln for ln in got["said"] if "aligned forward:" in ln]
    assert len(init) == 1 and len(model) == 1, got["said"]
    for part in ("rollout format fp8_block", "train forward aligned", "activations quantized "
                 "(per_token_group, 1x128 groups)", "sync k: 0, 0.00473, 0.00154",
                 "replaced by QrlSlimeQuantizer (QuantSpec fp8_block packs, seed 1234)"):
        assert part in init[0], init[0]
    assert ("8 linears rollout-aligned to fp8_block (attention 4, mlp 4; "
            "AlignedTELayerNormColumnParallelLinear x4, AlignedTERowParallelLinear x4), gemm "
            "fake") in model[0], model[0]
    # the 8 linears (qkv, proj, fc1, fc2 of 2 layers) of the TE spec were swapped
    assert got["hook_timing"]["linears"] == 8
    # weights written as Megatron's optimizer writes them (.data.copy_: same storage, no
    # version bump), then slime's before-log-prob hook: every Q(W) is recomputed and the
    # log-prob forward equals one with the caches rebuilt from scratch
    timing = got["hook_timing"]
    assert timing["recomputed"] == 8 and timing["changed"] > 0.01
    assert timing["after_vs_rebuilt"] == 0.0
    # slime's log-prob forward vs transformers Qwen3 references on the same tokens. In FP32 the
    # aligned forward IS the fp8_block export's forward (dequantized codes and scales, SGLang's
    # 1x128 activation groups), and with quantization off the BF16 checkpoint's
    fp32 = got["logprobs_fp32"]
    assert fp32["aligned_vs_ref"] < 1e-5 and fp32["off_vs_hf_bf16"] < 1e-5
    assert fp32["off_vs_ref"] > 0.01
    # in BF16 the implementations' rounding differs (the floor, quantization off); each E4M3
    # activation code it pushes over a rounding boundary moves by a whole code step, so the
    # aligned gap to the reference is several floors, yet below the BF16 forward's gap
    lp = got["logprobs"]
    assert lp["tokens"] == 10 and lp["off_vs_hf_bf16"] < 0.01
    assert lp["off_vs_hf_bf16"] < lp["aligned_vs_ref"] < lp["off_vs_ref"]
    # slime's loss_function ran our loss; every parameter got a finite gradient
    assert {"pg_loss", "ratio_mean", "kl_behav_prox_k3", "entropy"} <= set(got["metrics"])
    assert ("tbpo_seq_mask_frac" in got["metrics"]) and got["grad_params"] == 18
    assert got["grad_finite"]
    # the sync sends exactly the export's tensors: same names, shapes, dtypes; the quantized
    # ones bit for bit; only the layer norms differ, by the AQN noise of the step the
    # before-train-step hook set (rollout 0 -> the sync after it is step 1)
    sync = got["sync"]
    assert sync["quantization_config"]["weight_block_size"] == [128, 128]
    assert sync["missing"] == sync["extra"] == sync["layout_differs"] == []
    assert sync["fp8_tensors"] == 14 and sync["aqn_step"] == 1
    assert sync["value_differs"] == [f"model.layers.{i}.{n}_layernorm.weight"
                                     for i in (0, 1) for n in ("input", "post_attention")]
    post = got["postprocess"]
    assert post["loss_masks"] == [[1, 1, 1, 1], [1, 1, 0, 1, 1, 1]]
    assert len(post["rates"]) == 5
