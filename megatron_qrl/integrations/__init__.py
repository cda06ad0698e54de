"""Adapters into other RL frameworks' extension points; one subpackage per host framework.

``slime``: THUDM/slime 0.3.1 through its dotted-path hooks (custom loss, custom TIS, Megatron
init / before-log-prob / before-train-step hooks, rollout-data post-process, ``--spec``) and a
launcher around its ``train.py``. See docs/SLIME.md.
"""
