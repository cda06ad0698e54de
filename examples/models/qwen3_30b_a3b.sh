# Qwen3-30B-A3B (megatron_qrl/data/configs/qwen3_30b_a3b.json) as Megatron flags.
MODEL_ARGS=(
    --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144
    --num-attention-heads 32 --group-query-attention --num-query-groups 4 --kv-channels 128
    --qk-layernorm --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
    --position-embedding-type rope --rotary-base 1000000 --max-position-embeddings 40960
    --untie-embeddings-and-output-weights --disable-bias-linear --vocab-size 151936
    --make-vocab-size-divisible-by 128
    --num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 768
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
    --moe-router-dtype fp32 --moe-token-dispatcher-type alltoall --moe-grouped-gemm
    --moe-permute-fusion --moe-router-fusion
)
# TE's fused grouped GEMM for the experts' GroupedLinear (one native grouped GEMM instead of
# TE's per-GEMM path): 13.0% vs 10.5% trainer MFU on the 4-layer slice on one H200
# (bench/results/moe30b_ee27c8e.jsonl, row none-mb8-gg-pf-rf). TE 2.20 reads it per layer build.
# It matters with --qrl-train-moe-experts megatron only: the qwen3-30b-a3b preset's stacked
# experts replace TE's GroupedLinear by one torch grouped GEMM per expert linear.
export NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM="${NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM:-1}"
