# Qwen3-4B (HF config.json of Qwen/Qwen3-4B) as Megatron flags.
MODEL_ARGS=(
    --num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728
    --num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128
    --qk-layernorm --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
    --position-embedding-type rope --rotary-base 1000000 --max-position-embeddings 40960
    --disable-bias-linear --vocab-size 151936 --make-vocab-size-divisible-by 128
)
