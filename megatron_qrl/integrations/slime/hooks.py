"""slime's Megatron hooks: init (options, UAQ check, weight-sync quantizer), before-log-prob and
before-train-step (drive the rollout-aligned forward and the AQN step).

- ``--custom-megatron-init-path megatron_qrl.integrations.slime.hooks.qrl_megatron_init``:
  ``(args)``, once per trainer process after Megatron's initialisation. Validates the qrl
  options (:func:`~megatron_qrl.integrations.slime.options.slime_options`), checks that UAQ was
  applied exactly once, and installs the QuantSpec weight-sync quantizer
  (:mod:`megatron_qrl.integrations.slime.quantizer`) for quantized formats or AQN; says what
  it installed in one ``[megatron_qrl]`` line on rank 0 (:mod:`~.report`).
- ``--custom-megatron-before-log-prob-hook-path ...hooks.qrl_before_log_prob``:
  ``(args, model, store_prefix)`` before each log-prob forward (actor, ref, teacher).
  With ``--qrl-train-forward aligned`` (the layer spec of
  :mod:`megatron_qrl.integrations.slime.model`) it makes every aligned linear re-quantize
  its weights at the next forward; the aligned model keeps the TE spec's parameter names, so
  slime's weight converter and torch_dist checkpoints see the model they know.
- ``--custom-megatron-before-train-step-hook-path ...hooks.qrl_before_train_step``:
  ``(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)`` before each step.

UAQ (QuRL eq. 10-12) is applied once, offline, to the weights both sides start from
(``tools/convert_hf_to_megatron.py --uaq-scale S`` then ``tools/convert_megatron_to_hf.py``,
which records ``megatron_qrl_uaq_scale`` in config.json); ``--qrl-uaq-scale S`` makes the init
hook require that record on slime's ``--hf-checkpoint``, so the scale can be neither missing
nor applied twice. AQN noise is added per sync to the rollout copy only (the quantizer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_qrl.config import QrlArgumentError
from megatron_qrl.integrations.slime.model import aligned_states
from megatron_qrl.integrations.slime.options import SPEC, SlimeQrlOptions, slime_options
from megatron_qrl.integrations.slime.report import aligned_line, install_line, say


def check_uaq_once(opts: SlimeQrlOptions, hf_checkpoint: str | None) -> None:
    """``--qrl-uaq-scale S`` needs slime's ``--hf-checkpoint`` to record exactly S."""
    from megatron_qrl.models.convert import UAQ_CONFIG_KEY

    if not opts.uaq.enabled:
        return
    how = (f"apply it once with `python tools/convert_hf_to_megatron.py --hf-dir HF --out M "
           f"--uaq-scale {opts.uaq.scale}` + `python tools/convert_megatron_to_hf.py --megatron-dir M --out HF2`, then "
           "convert that HF directory for slime (and export the rollout format from it)")
    cfg_path = Path(hf_checkpoint or "") / "config.json"
    if not hf_checkpoint or not cfg_path.is_file():
        raise QrlArgumentError(f"--qrl-uaq-scale {opts.uaq.scale}: no config.json under slime's "
                               f"--hf-checkpoint {hf_checkpoint!r} to check the UAQ record; {how}")
    recorded = json.loads(cfg_path.read_text()).get(UAQ_CONFIG_KEY)
    if recorded is None or float(recorded) != float(opts.uaq.scale):
        raise QrlArgumentError(f"--qrl-uaq-scale {opts.uaq.scale}: {cfg_path} records "
                               f"{UAQ_CONFIG_KEY}={recorded!r}; UAQ is applied once, offline: {how}")


def qrl_megatron_init(args: Any) -> None:
    """slime ``--custom-megatron-init-path`` hook (see the module docstring)."""
    from megatron_qrl.integrations.slime.quantizer import install_quantizer

    opts = slime_options(args)
    check_uaq_once(opts, getattr(args, "hf_checkpoint", None))
    total = getattr(args, "num_rollout", None)
    if opts.aqn.enabled and not total:
        raise QrlArgumentError("--qrl-aqn-enabled: the noise schedule spans slime's rollouts, "
                               f"but args.num_rollout is {total!r}; set --num-rollout")
    quantizer = None
    if opts.rollout.spec.quantizes_weights or opts.aqn.enabled:
        quantizer = install_quantizer(opts.rollout.format, opts.aqn, opts.run.seed,
                                      total_steps=total or 1)
    say(install_line(opts, quantizer, total or 1))


def _drive_aligned(args: Any, model: Any) -> None:
    """Every aligned linear recomputes Q(W) at its next forward (weights were switched or
    stepped since); a run that asked for the aligned forward without the spec fails here.
    The first call on a model (no state marked yet) says what was swapped, on rank 0, and
    names the aligned weights in the Q(W) refresh's errors; each call reads the finiteness of
    the refresh before (``AlignedForwardState.mark_weights_updated``)."""
    opts = slime_options(args)
    states = aligned_states(model)
    if opts.train.forward == "aligned" and not states:
        raise QrlArgumentError("--qrl-train-forward aligned, but slime's model has no aligned "
                               f"linears: add --spec {' '.join(SPEC)}")
    if states and all(state.version == 0 for state in states):
        say(aligned_line(model, states))
        for state in states:  # errors of the Q(W) refresh name the parameter
            for chunk in model if isinstance(model, (list, tuple)) else [model]:
                state.name_modules(chunk)
    for state in states:
        state.mark_weights_updated()


def qrl_before_log_prob(args: Any, model: Any, store_prefix: str) -> None:
    """slime before-log-prob hook: the recompute (and ref / teacher) forwards see fresh Q(W)."""
    _drive_aligned(args, model)


def qrl_before_train_step(args: Any, rollout_id: int, step_id: int, model: Any, optimizer: Any,
                          opt_param_scheduler: Any) -> None:
    """slime before-train-step hook: fresh Q(W) after the last step; the sync that follows this
    rollout's training draws AQN noise of step ``rollout_id + 1`` (the first sync is step 0)."""
    from megatron_qrl.integrations.slime.quantizer import installed_quantizer

    _drive_aligned(args, model)
    for state in aligned_states(model):  # a NaN weight's error before this step's update
        state.check_before_steps(optimizer)
    quantizer = installed_quantizer()
    if quantizer is not None:
        quantizer.step = rollout_id + 1
