"""Fused-MoE kernel configurations for SGLang: tuning (:mod:`.moe_tune`, run by
``tools/tune_fused_moe.py``) and the shipped, tuned files (:mod:`.moe_configs`, ``configs/``)."""
