"""H200: megatron_qrl.sync.protocol.marlin bit-equal to SGLang 0.5.17's own Marlin repack
(``gptq_marlin_repack``, ``gptq_marlin_moe_repack``) and scale permutation
(``marlin_permute_scales``, ``marlin_moe_permute_scales``) at Qwen3-30B-A3B's shapes (fewer
experts), and a fused member's repack equal to its columns of the fused parameter's (the
direct writer's w4a16 design writes members on their own).

    source .stage/recipe/setup.sh
    python -m pytest -q tests/gpu/test_marlin_layout.py -x -s
"""

from __future__ import annotations

import pytest
import torch

from megatron_qrl.quant.numerics import pack_int4_to_int32
from megatron_qrl.sync.protocol.marlin import (
    marlin_from_codes,
    marlin_repack,
    marlin_scales,
    marlin_unpack,
    marlin_unscales,
    repacker,
)
from tests.gpu import skip_unless_sglang_gpu

skip_unless_sglang_gpu("Marlin layout tests")

GROUP = 128


def _words(*shape, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(-2**31, 2**31, shape, generator=g, device="cuda",
                         dtype=torch.int64).to(torch.int32)


def _empty(*lead):
    return torch.empty(*lead, 0, dtype=torch.int32, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (64, 128)],
                         ids=["qkv", "o_proj", "tiny"])
def test_dense_repack_and_scales_equal_sglang(n, k):
    """Catches: any difference between our reading of the kernel and the kernel."""
    from sglang.kernels.ops.quantization.gptq_marlin_repack import gptq_marlin_repack
    from sglang.srt.layers.quantization.marlin_utils import marlin_permute_scales

    packed = _words(n, k // 8, seed=n)
    want = gptq_marlin_repack(packed.t().contiguous(), _empty(), k, n, 4)
    got = marlin_repack(packed)
    assert torch.equal(got, want)
    assert torch.equal(marlin_unpack(want), packed)
    s = torch.randn(n, k // GROUP, device="cuda").to(torch.bfloat16)
    want_s = marlin_permute_scales(s.t().contiguous(), k, n, GROUP)
    assert torch.equal(marlin_scales(s, GROUP < k), want_s)
    assert torch.equal(marlin_unscales(want_s, GROUP < k), s)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(1536, 2048), (2048, 768)], ids=["w13", "w2"])
def test_expert_repack_and_scales_equal_sglang(n, k):
    """The MoE variants, with SGLang's own size arguments (``w13``'s scale permutation gets
    the repacked width as ``size_k``, as ``CompressedTensorsWNA16MoE`` passes it)."""
    from sglang.srt.hardware_backend.gpu.quantization.gptq_kernels import gptq_marlin_moe_repack
    from sglang.srt.layers.quantization.marlin_utils import marlin_moe_permute_scales

    e = 4
    packed = _words(e, n, k // 8, seed=k)
    want = gptq_marlin_moe_repack(packed.transpose(1, 2).contiguous(), _empty(e), k, n, 4)
    assert torch.equal(marlin_repack(packed), want)
    s = torch.randn(e, n, k // GROUP, device="cuda").to(torch.bfloat16)
    size_k = want.shape[2] if n == 1536 else k
    want_s = marlin_moe_permute_scales(s.transpose(1, 2).contiguous(), size_k, n, GROUP)
    assert torch.equal(marlin_scales(s, GROUP < size_k), want_s)


@pytest.mark.gpu
def test_a_member_repacks_into_its_own_columns():
    """q / k / v (4096 / 512 / 512 rows, 64-aligned) repacked alone fill the columns
    ``[2 start, 2 stop)`` of the fused repack, and their scales the columns
    ``[start, stop)``. Catches: a tile that spans members (the design's premise wrong)."""
    from sglang.kernels.ops.quantization.gptq_marlin_repack import gptq_marlin_repack

    k, sizes = 2048, (4096, 512, 512)
    members = [_words(m, k // 8, seed=m + i) for i, m in enumerate(sizes)]
    fused = torch.cat(members)
    whole = gptq_marlin_repack(fused.t().contiguous(), _empty(), k, fused.shape[0], 4)
    scales = [torch.randn(m, k // GROUP, device="cuda").to(torch.bfloat16) for m in sizes]
    whole_s = marlin_scales(torch.cat(scales), True)
    start = 0
    for m, p, s in zip(sizes, members, scales):
        assert torch.equal(whole[:, 2 * start: 2 * (start + m)], marlin_repack(p))
        assert torch.equal(whole_s[:, start: start + m], marlin_scales(s, True))
        start += m


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(1536, 2048), (2048, 768)], ids=["w13", "w2"])
def test_the_writers_repacks_equal_sglang(n, k):
    """The direct writer's two repacks: from the quantizer's signed int4 codes
    (``marlin_from_codes``) and the one :func:`repacker` picks on CUDA (sgl_kernel's
    ``gptq_marlin_repack`` where it imports), both equal to SGLang's JIT kernel per expert.
    Catches: a +8 offset or [N, K] orientation wrong for codes, sgl_kernel's argument order,
    the repacker's one call for the whole stack (``repack_rows``) not giving each expert's."""
    from sglang.kernels.ops.quantization.gptq_marlin_repack import gptq_marlin_repack

    g = torch.Generator(device="cuda").manual_seed(k)
    codes = torch.randint(-8, 8, (3, n, k), generator=g, device="cuda", dtype=torch.int8)
    packed = pack_int4_to_int32(codes.reshape(-1, k)).reshape(3, n, k // 8)
    want = torch.stack([gptq_marlin_repack(p.t().contiguous(), _empty(), k, n, 4)
                        for p in packed])
    assert torch.equal(marlin_from_codes(codes), want)
    pick = repacker(torch.device("cuda"))
    print(f"repacker on cuda: {getattr(pick, '__module__', '')}.{pick.__name__}")
    assert torch.equal(pick(packed), want)
