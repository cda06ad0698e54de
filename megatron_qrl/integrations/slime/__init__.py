"""megatron_qrl inside a slime (THUDM/slime 0.3.1) run, through slime's own extension points.

Dotted paths to add to a slime launch script (docs/SLIME.md maps every option):

- ``--loss-type custom_loss --custom-loss-function-path
  megatron_qrl.integrations.slime.loss.qrl_policy_loss``  (every ``--qrl-loss-kind``), or slime's
  PPO loss with ``--use-tis --custom-tis-function-path
  megatron_qrl.integrations.slime.loss.qrl_tis_function``;
- ``--custom-megatron-init-path megatron_qrl.integrations.slime.hooks.qrl_megatron_init``
  (options, UAQ check, QuantSpec weight-sync quantizer with AQN);
- ``--custom-megatron-before-log-prob-hook-path ...hooks.qrl_before_log_prob`` and
  ``--custom-megatron-before-train-step-hook-path ...hooks.qrl_before_train_step``;
- ``--spec megatron_qrl.integrations.slime.model qrl_layer_spec`` (aligned forward);
- ``--rollout-data-postprocess-path ...postprocess.qrl_rollout_data_postprocess`` (error tokens).

Options: ``qrl_*`` keys in ``--custom-config-path`` YAML, or ``--qrl-*`` flags with the
launcher ``python -m megatron_qrl.integrations.slime.launch`` (which also fills in the hooks).
Modules import slime lazily: this package imports without it.
"""
