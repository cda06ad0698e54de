"""CPU tests of the Marlin layout functions (megatron_qrl.sync.protocol.marlin) against a
line-by-line transcription of SGLang 0.5.17's ``gptq_marlin_repack_kernel`` (4 bits, no
perm) and ``marlin_permute_scales``; the GPU test (tests/gpu/test_marlin_layout.py) compares
them with SGLang's own kernels."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_qrl.quant.numerics import pack_int4_to_int32
from megatron_qrl.sync.protocol.marlin import (
    MarlinUnsupported,
    _tile_order,
    checkpoint_shape,
    from_live,
    live_shape,
    marlin_from_codes,
    marlin_repack,
    marlin_scales,
    marlin_unpack,
    marlin_unscales,
    repack_rows,
    repacker,
    to_live,
)


def _kernel(b_q: torch.Tensor, size_k: int, size_n: int) -> torch.Tensor:
    """``gptq_marlin_repack_kernel<.., 4, false>`` as written: ``b_q`` GPTQ words [K/8, N]."""
    b = b_q.view(-1).tolist()
    out = [0] * (size_k // 16 * size_n * 2)
    n_tiles = size_n // 64
    for kt in range(size_k // 16):
        for nt in range(n_tiles):
            sh = [[b[(kt * 2 + i) * size_n + nt * 64 + c] & 0xFFFFFFFF for c in range(64)]
                  for i in range(2)]  # the stage in shared memory: tile_ints rows x 64
            for tid in range(128):
                warp, th = tid // 32, tid % 32
                tc_col, tc_row = th // 4, (th % 4) * 2
                cur_n = warp * 16 + tc_col
                vals = [0] * 8
                for i, off in enumerate((0, 1, 8, 9)):
                    elem = tc_row + off
                    vals[i] = (sh[elem // 8][cur_n] >> (elem % 8 * 4)) & 0xF
                    vals[4 + i] = (sh[elem // 8][cur_n + 8] >> (elem % 8 * 4)) & 0xF
                res = 0
                for i, p in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):
                    res |= vals[p] << (i * 4)
                out[(kt * n_tiles + nt) * 128 + th * 4 + warp] = res
    w = torch.tensor(out, dtype=torch.int64)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32).view(size_k // 16, 2 * size_n)


def _permute_scales(s: torch.Tensor, size_k: int, size_n: int, group_size: int) -> torch.Tensor:
    """``marlin_utils.marlin_permute_scales`` / ``get_scale_perms`` as written."""
    scale_perm = [i + 8 * j for i in range(8) for j in range(8)]
    single = [2 * i + j for i in range(4) for j in [0, 1, 8, 9, 16, 17, 24, 25]]
    if group_size < size_k and group_size != -1:
        s = s.reshape((-1, len(scale_perm)))[:, scale_perm]
    else:
        s = s.reshape((-1, len(single)))[:, single]
    return s.reshape((-1, size_n)).contiguous()


def _words(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31, shape, generator=g, dtype=torch.int64).to(torch.int32)


@pytest.mark.parametrize("n,k", [(64, 16), (128, 32), (192, 48)])
def test_repack_equals_the_kernel(n, k):
    """Catches: a wrong nibble order in a word (``pack_idx``), a wrong k offset
    (``{0, 1, 8, 9}``) or n offset (+8), tiles placed in the wrong output words, a missed
    transpose of the checkpoint's [N, K/8] words."""
    packed = _words(n, k // 8, seed=n + k)
    want = _kernel(packed.t().contiguous(), k, n)
    assert torch.equal(marlin_repack(packed), want)


def test_experts_repack_one_by_one_and_round_trip():
    """``gptq_marlin_moe_repack`` is the per-expert loop; the inverse gives the checkpoint
    words back. Catches: the expert dim mixed into the tiles, an inverse that is not one."""
    packed = _words(3, 128, 4, seed=7)
    got = marlin_repack(packed)
    for e in range(3):
        assert torch.equal(got[e], _kernel(packed[e].t().contiguous(), 32, 128))
    assert torch.equal(marlin_unpack(got), packed)


@pytest.mark.parametrize("lead", [(), (3,), (2, 2)])
def test_a_stack_repacks_in_one_call_of_the_kernel(lead):
    """``repack_rows``: the kernel (its transcription) called once on the slices' rows
    concatenated gives each slice's own repack (the CUDA repacker's way with an expert
    stack). Catches: slices taken from the wrong columns of the one result (``2N e``), a
    missing transpose of the result's slice axis."""
    n, k = 128, 32
    packed = _words(*lead, n, k // 8, seed=11)
    calls = []

    def kernel_2d(words):
        calls.append(tuple(words.shape))
        return _kernel(words.t().contiguous(), k, words.shape[0])

    got = repack_rows(kernel_2d, packed)
    assert calls == [(math.prod(lead) * n, k // 8)]
    assert got.shape == (*lead, k // 16, 2 * n)
    assert torch.equal(got, marlin_repack(packed))


@pytest.mark.parametrize("grouped", [True, False])
def test_scales_equal_marlin_permute_scales_and_round_trip(grouped):
    """Catches: the grouped / single permutation swapped, the permutation applied before the
    transpose (columns of the checkpoint's [N, K/group] instead of [K/group, N])."""
    g = torch.Generator().manual_seed(3)
    s = torch.randn(2, 128, 4, generator=g).to(torch.bfloat16)  # [E, N, K/group]
    size_k, group = (512, 128) if grouped else (128, 128)
    got = marlin_scales(s, grouped)
    for e in range(2):
        want = _permute_scales(s[e].t().contiguous(), size_k, 128, group)
        assert torch.equal(got[e], want)
    assert torch.equal(marlin_unscales(got, grouped), s)


def test_shapes_off_the_tiles_are_refused():
    with pytest.raises(ValueError, match=r"N=96, K=16; Marlin tiles need N % 64 == 0"):
        marlin_repack(_words(96, 2))


def test_the_tile_order_is_a_permutation():
    """Every one of a tile's 16 x 64 nibbles goes to exactly one place. Catches: a
    transcription that drops or duplicates a position (the repack would lose codes)."""
    assert sorted(_tile_order()) == list(range(16 * 64))


def test_codes_repack_without_the_checkpoint_words_and_round_trip():
    """The writer's repack from the quantizer's signed codes equals the repack of their
    compressed-tensors words (nibble = code + 8), and unpacking gives those words back.
    Catches: a missing +8 offset, codes taken [K, N] instead of [N, K]."""
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(-8, 8, (2, 192, 256), generator=g, dtype=torch.int8)
    words = pack_int4_to_int32(codes.reshape(-1, 256)).reshape(2, 192, 32)
    live = marlin_from_codes(codes)
    assert live.shape == (2, 16, 384) and torch.equal(live, marlin_repack(words))
    assert torch.equal(marlin_unpack(live), words)


@pytest.mark.parametrize("kind,shape", [("codes", (3, 128, 16)), ("scales", (3, 128, 2)),
                                        ("scales_single", (128, 1))])
def test_to_live_and_back_is_the_identity(kind, shape):
    """The writer's transform and the read-back's inverse, with the shapes the layout uses.
    Catches: a read-back that does not undo the writer's layout."""
    g = torch.Generator().manual_seed(9)
    x = (_words(*shape, seed=4) if kind == "codes"
         else torch.randn(shape, generator=g).to(torch.bfloat16))
    live = to_live(kind, x)
    assert tuple(live.shape) == live_shape(kind, shape)
    assert checkpoint_shape(kind, tuple(live.shape)) == shape
    back = from_live(kind, live)
    assert torch.equal(back, x) and back.stride()[-1] == 1


def test_the_cpu_repacker_is_the_torch_one():
    assert repacker(torch.device("cpu")) is marlin_repack


def test_scales_off_the_runs_are_refused():
    with pytest.raises(MarlinUnsupported, match=r"N=96 rows; .*N % 64 == 0"):
        marlin_scales(torch.zeros(96, 2, dtype=torch.bfloat16), True)
