# Model shape of the CPU default job: the built-in tiny Qwen3-MoE (megatron_qrl/data/tiny_model.py).
# qrl-train builds it itself (--qrl-model tiny-moe); MODEL_ARGS lists the same shape as
# Megatron flags for reference. Sourced by examples/run_tiny_cpu.sh.
QRL_MODEL_ARGS=(--qrl-model tiny-moe)
MODEL_ARGS=(
    --num-layers 2 --hidden-size 128 --ffn-hidden-size 256
    --num-attention-heads 2 --group-query-attention --num-query-groups 1 --kv-channels 128
    --qk-layernorm --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
    --position-embedding-type rope --rotary-base 10000 --max-position-embeddings 128
    --untie-embeddings-and-output-weights --disable-bias-linear --vocab-size 128
    --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 128
)
