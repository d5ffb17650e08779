"""The Gluon Hopper forward (kernels/gluon/fwd.py) compiled for sm_90 on CPU: no GPU needed.

Checked on each compiled variant (``VARIANTS``: non-causal MHA, the causal band, the
ring's merging step into fp32 sums with GQA, three stages, head_dim 64, a window's lower
edge): the scores and P V are wgmmas of the expected shapes and counts, the partitions
keep their register budgets, shared memory fits an H100's 227 KB, K and V arrive by TMA,
ptxas neither serializes the wgmmas nor spills, every tile loop holds one step's wgmmas
and 64 exp2 a thread (and 2 for the rescale), and the element mask (a selp to -inf) exists
in the masked variants only, in loops of their own. The argument checks run too. Correctness on a GPU is
tests/test_gluon_fwd_gpu.py's; the compile helpers are tests/test_gluon_compile.py's.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper",
                    reason="this triton has no Gluon Hopper module")

from test_gluon_compile import (BIN, DROPOUT_ARGUMENTS, H100_SHARED, _ptx_ops, _tile_loops,  # noqa: E402
                                assemble, narrow)

def _head_dim(name: str) -> int:
    return VARIANTS[name].get("head_dim", 128)


VARIANTS = {
    "mha": dict(),
    "causal": dict(causal_offset=0),
    "gqa-causal-add": dict(heads=8, kv_heads=2, causal_offset=0, accumulate=True, out_dtype=torch.float32),
    "causal-stages3": dict(causal_offset=-100, stages=3),
    "hd64-causal": dict(causal_offset=0, head_dim=64),
    "hd64-gqa-add": dict(heads=8, kv_heads=2, accumulate=True, out_dtype=torch.float32, head_dim=64),
    # a window's lower edge (j >= i + band_lo), with the causal edge and alone
    "window": dict(causal_offset=0, band_lo=-300),
    "window-lo-add": dict(band_lo=-200, accumulate=True, out_dtype=torch.float32),
    # segment ids (packed documents): with the causal band, alone with GQA and the merge, with a
    # window, at head_dim 64
    "documents": dict(causal_offset=0, segments=True),
    "documents-gqa-add": dict(heads=8, kv_heads=2, accumulate=True, out_dtype=torch.float32, segments=True),
    "documents-window": dict(causal_offset=0, band_lo=-300, segments=True),
    "documents-hd64": dict(causal_offset=0, head_dim=64, segments=True),
    # a block mask (block-sparse): alone, with the causal band, with GQA, a window and the merge
    "blocks": dict(blocks=True),
    "blocks-causal": dict(causal_offset=0, blocks=True),
    "blocks-gqa-window-add": dict(heads=8, kv_heads=2, causal_offset=0, band_lo=-300, accumulate=True,
                                  out_dtype=torch.float32, blocks=True),
}
# Variants whose ptxas spills a few bytes outside the tile loops (the loops themselves must
# not touch local memory).
SPILLS_OUTSIDE_LOOPS = {"documents-window", "documents-hd64"}
# The unmasked loops' length against the unbanded loop of their head_dim: 5% (documents at
# head_dim 64: 7%, 441 SASS instructions against 414; the Gluon forward is not routed there).
LOOP_SLACK = {"documents-hd64": 1.07}
_COMPILED: dict = {}


def _compiled(name: str):
    """(kernel, SASS, ptxas -v stderr) of a variant, once per session."""
    if name not in _COMPILED:
        missing = [t for t in ("ptxas", "nvdisasm") if not (BIN / t).exists()]
        if missing:
            pytest.skip(f"this triton ships no {', '.join(missing)}")
        from ringflash.kernels.gluon import compile_fwd_sm90
        kernel = compile_fwd_sm90(**VARIANTS[name])
        _COMPILED[name] = (kernel, *assemble(kernel))
    return _COMPILED[name]


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request):
    return (request.param, *_compiled(request.param))


def _edges(name: str) -> int:
    """The band's edges the variant masks: the causal one, a window's lower one."""
    return (VARIANTS[name].get("causal_offset") is not None) + (VARIANTS[name].get("band_lo") is not None)


def _masks(name: str) -> int:
    """The element masks a masked step applies: the band's edges, and the ids' compare."""
    return _edges(name) + bool(VARIANTS[name].get("segments"))


def _masked_loops(name: str) -> int:
    """The masked tile loops a consumer group runs: one an edge of the band; with segment
    ids both (tiles before and after the unmasked ones); with a block mask one under any
    band (the blocks it crosses, each step masked by every edge)."""
    if VARIANTS[name].get("blocks"):
        return int(_edges(name) > 0)
    return 2 if VARIANTS[name].get("segments") else _edges(name)


def test_products_loads_and_resources(variant):
    """Per consumer group: the first tile's scores (head_dim / 16 wgmma k-steps of 64 x 128;
    twice, masked and not, with a band), per loop kind (unmasked, and one masked kind an
    edge of the band) a step's scores and P V (8 of 64 x head_dim), then the last P V; K
    and V by 4-D TMA loads; 12 warps at 168 registers, consumers raised to 240; shared
    memory within 227 KB."""
    name, kernel, _, _ = variant
    ptx = kernel.asm["ptx"]
    shapes = Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
    loops, d = _masked_loops(name), _head_dim(name)
    want = Counter({"m64n128k16": 2 * d // 16 * ((2 if loops else 1) + 1 + loops)})
    want[f"m64n{d}k16"] += 2 * 8 * (1 + loops + 1)
    assert shapes == want, shapes
    ops = _ptx_ops(ptx)
    assert sum(n for op, n in ops.items() if op.startswith("cp.async.bulk.tensor.4d")) >= 4, ops  # Q x 2, K, V
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;", ptx)
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx)
    assert kernel.metadata.num_warps == 12 and kernel.metadata.shared <= H100_SHARED, kernel.metadata.shared


def test_no_serialization_no_spills(variant):
    name, _, sass, stderr = variant
    assert "serialized" not in stderr and not re.search(r"C751\d", stderr), stderr
    if name in SPILLS_OUTSIDE_LOOPS:
        spilled = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", stderr)
        assert spilled and max(int(spilled[1]), int(spilled[2])) <= 8, stderr
        assert not any(op.startswith(("LDL", "STL")) for loop in _tile_loops(sass) for op in loop)
    else:
        assert re.search(r"0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", stderr), stderr


def test_tile_loops_and_the_mask(variant):
    """Each tile loop: 16 HGMMA (12 at head_dim 64), 66 MUFU (64 exp2 a thread and the
    rescale's 2); the masked loops (one a group and edge of the band) add 64 FSEL an edge
    (the -inf selects: each masked step masks by every edge) and 2 (the max of -inf taken as
    0); the unmasked ones have none, and stay within 5% of the unbanded loop of their
    head_dim."""
    name, kernel, sass, _ = variant
    loops = _tile_loops(sass)
    kinds, masks = _masked_loops(name), _masks(name)
    assert len(loops) == 2 * (1 + kinds), [len(loop) for loop in loops]
    masked = [loop for loop in loops if "FSEL" in loop]
    assert len(masked) == 2 * kinds
    plain = "mha" if _head_dim(name) == 128 else "hd64-gqa-add"  # no band
    reference = max(len(loop) for loop in _tile_loops(_compiled(plain)[1]))
    for loop in loops:
        count = Counter(loop)
        assert count["HGMMA"] == _head_dim(name) // 16 + 8 and count["MUFU"] == 66, count
        if loop in masked:
            assert count["FSEL"] == 64 * masks + 2, count
        else:
            assert len(loop) <= LOOP_SLACK.get(name, 1.05) * reference, (len(loop), reference)
    assert kernel.asm["ptx"].count("selp.f32") >= 2 * 64 * masks


def _bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


def _blocks(mask: torch.Tensor):
    from ringflash.kernels.masks import Blocks
    return Blocks(mask)


@pytest.mark.parametrize("change, error, match", [
    (dict(q=_bf16(1, 256, 2, 128).float()), TypeError, "q must be bfloat16"),
    (dict(lse=torch.zeros(1, 2, 256, dtype=torch.float64)), TypeError, "lse must be float32"),
    (dict(out=torch.zeros(1, 256, 2, 128, dtype=torch.int32)), TypeError, "out must be a float tensor"),
    (dict(q=_bf16(1, 256, 2, 96), k=_bf16(1, 256, 2, 96), v=_bf16(1, 256, 2, 96), out=_bf16(1, 256, 2, 96)),
     ValueError, "head_dim must be one of (64, 128)"),
    (dict(q=_bf16(1, 200, 2, 128), out=_bf16(1, 200, 2, 128), lse=torch.zeros(1, 2, 200)), ValueError,
     "q's seqlen must be a positive multiple of 128"),
    (dict(k=_bf16(1, 256, 3, 128), v=_bf16(1, 256, 3, 128)), ValueError, "k must be (B, Sk, Hkv, D)"),
    (dict(lse=torch.zeros(1, 256, 2)), ValueError, "lse must have shape (1, 2, 256)"),
    (dict(softmax_scale=0.0), ValueError, "softmax_scale must be a positive finite"),
    (dict(causal_offset=0.5), TypeError, "causal_offset must be an int or None"),
    (dict(band_lo=True), TypeError, "band_lo must be an int or None"),
    (dict(causal_offset=0, band_lo=-64), ValueError, "runs on a Hopper"),  # a window
    (dict(accumulate=True, out_partial=torch.zeros(1, 2, 256, 128).transpose(1, 2)), ValueError,
     "out_partial must have out's strides"),
    (dict(out_partial=torch.zeros(1, 256, 2, 128)), ValueError, "out_partial is read only with accumulate=True"),
    (dict(accumulate=True, out_partial=torch.zeros(1, 256, 2, 128)), ValueError, "runs on a Hopper"),
    (dict(), ValueError, "runs on a Hopper (sm_90) GPU"),
    (dict(q_segments=torch.zeros(1, 256, dtype=torch.int32)), ValueError, "q_segments and k_segments go together"),
    (dict(q_segments=torch.zeros(1, 256, dtype=torch.int64), k_segments=torch.zeros(1, 256, dtype=torch.int64)),
     TypeError, "q_segments must be int32"),
    (dict(q_segments=torch.zeros(1, 128, dtype=torch.int32), k_segments=torch.zeros(1, 256, dtype=torch.int32)),
     ValueError, "q_segments must have shape (1, 256)"),
    (dict(q_segments=torch.zeros(1, 256, dtype=torch.int32), k_segments=torch.zeros(1, 256, dtype=torch.int32)),
     ValueError, "runs on a Hopper"),
    (dict(blocks=torch.ones(1, 2, 2, dtype=torch.bool)), TypeError, "blocks must be a kernels.masks.Blocks"),
    (dict(blocks=_blocks(torch.ones(3, 2, 2, dtype=torch.bool))), ValueError, "blocks.mask must be (1 or heads, 2, 2)"),
    (dict(blocks=_blocks(torch.ones(1, 2, 2, dtype=torch.bool)), q_segments=torch.zeros(1, 256, dtype=torch.int32),
          k_segments=torch.zeros(1, 256, dtype=torch.int32)), ValueError, "blocks with segment ids is not served"),
    (dict(blocks=_blocks(torch.ones(2, 2, 2, dtype=torch.bool)), causal_offset=0), ValueError, "runs on a Hopper"),
    # dropout: not with a block mask, and tests/test_gluon_compile.py's DROPOUT_ARGUMENTS
    (dict(dropout_p=0.1, pos=(0, 0, 1, 0), blocks=_blocks(torch.ones(1, 2, 2, dtype=torch.bool))), ValueError,
     "attn_fwd_sm90: dropout with blocks is not served"),
    *DROPOUT_ARGUMENTS,
])
def test_argument_checks(change, error, match):
    from ringflash.kernels.gluon import attn_fwd_sm90
    args = dict(q=_bf16(1, 256, 2, 128), k=_bf16(1, 256, 2, 128), v=_bf16(1, 256, 2, 128),
                out=_bf16(1, 256, 2, 128), lse=torch.zeros(1, 2, 256), softmax_scale=0.1, causal_offset=None,
                accumulate=False, out_partial=None, band_lo=None, q_segments=None, k_segments=None, blocks=None)
    args.update(change)
    with pytest.raises(error, match=re.escape(match)):
        attn_fwd_sm90(**args)


def _k_tiles(m0, offset, band_lo, n_k, tiles):
    """kernels/gluon/fwd.py's ``_k_tiles``, line for line in Python (BLOCK_M = BLOCK_N = 128)."""
    end, full = n_k, n_k
    if offset is not None:
        end = min((max(m0 + 128 + offset, 0) + 127) // 128, n_k)
        full = min(max(m0 + offset + 1, 0) // 128, end)
    start, u0, u1 = 0, 0, full
    if band_lo is not None:
        start = min(max(m0 + band_lo, 0) // 128, end)
        u0 = min(max((max(m0 + 127 + band_lo, 0) + 127) // 128, start), end)
        u1 = max(full, u0)
    return (start, u0, u1, end) if tiles is None else narrow(start, u0, u1, end, tiles)


def _ids(gen, n, holes: bool, pad: bool):
    lengths = []
    while sum(lengths) < n:
        lengths.append(int(torch.randint(1, 400, (1,), generator=gen)) if torch.rand(1, generator=gen) < 0.7
                       else 128 * int(torch.randint(1, 4, (1,), generator=gen)))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:n]
    if holes:
        ids[torch.randint(0, n, (6,), generator=gen)] = -1
    if pad:
        ids[-int(torch.randint(1, 300, (1,), generator=gen)):] = -1
    return ids


def segment_draws(seed: int, trials: int = 60):
    """Random packed documents for the tile walks' tests, one a trial: (sq, sk, q_ids, k_ids,
    causal offset, band_lo, the band (sq, sk) bool, visible: the band and the same document,
    padding seeing nothing). Padding at the end and inside documents, the ring's shifted
    pairs (queries the shard after the keys'), the causal band with offsets, a window."""
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        sq, sk = (128 * int(torch.randint(1, 9, (1,), generator=gen)) for _ in range(2))
        shifted = trial % 3 == 0
        ids = _ids(gen, sq + sk if shifted else max(sq, sk), holes=trial % 4 == 1, pad=trial % 5 == 2)
        q_ids, k_ids = (ids[sk:sk + sq], ids[:sk]) if shifted else (ids[:sq], ids[:sk])
        offset = [None, 0, 128, -100, 37, sk][trial % 6]
        band_lo = [None, None, -300, -1, -700][trial % 5]
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
        band = torch.ones(sq, sk, dtype=torch.bool)
        if offset is not None:
            band &= j <= i + offset
        if band_lo is not None:
            band &= j >= i + band_lo
        visible = (q_ids[:, None] == k_ids[None, :]) & (q_ids[:, None] >= 0) & band
        yield sq, sk, q_ids, k_ids, offset, band_lo, band, visible


def test_segment_tiles_walk_every_visible_key():
    """The forward's tile walk with segment ids (``masks.segment_tiles`` intersected with the
    band as ``_k_tiles`` does), against brute force on random packed documents
    (``segment_draws``): every visible (query, key) pair lies in its Q tile's [start, end),
    and every pair of tiles [u0, u1) is visible (the kernel skips the mask there); without a
    band, [start, end) is exactly the tiles from the first visible key's to the last's."""
    from ringflash.kernels.masks import segment_ranges, segment_tiles
    for trial, (sq, sk, q_ids, k_ids, offset, band_lo, _, visible) in enumerate(segment_draws(0)):
        tiles = segment_tiles(segment_ranges(q_ids[None].int(), k_ids[None].int()), sk)[0]
        for m in range(sq // 128):
            start, u0, u1, end = _k_tiles(128 * m, offset, band_lo, sk // 128, tiles[m].tolist())
            assert start <= u0 <= u1 <= end, (trial, m, start, u0, u1, end)
            rows = visible[128 * m:128 * (m + 1)]
            cols = rows.any(0).nonzero().flatten()
            if len(cols):
                assert start * 128 <= int(cols.min()) and int(cols.max()) < end * 128, (trial, m, start, end)
            assert bool(rows[:, u0 * 128:u1 * 128].all()), (trial, m, u0, u1)
            if offset is None and band_lo is None:  # the ids alone: the walk is the visible keys' tiles, no more
                hull = (int(cols.min()) // 128, int(cols.max()) // 128 + 1) if len(cols) else (start, start)
                assert (start, end) == hull, (trial, m, start, end, hull)


def test_a_block_masks_launch_runs_its_long_rows_first():
    """Under a block mask the forward's CTAs run in ``masks.program_order``'s order, which
    the launch passes (kernels/gluon/launch.py, ``_block_args``): every (batch, head, Q
    tile) program once; without the band a global row's programs first, one a head, then
    the rest in the grid's order; under the causal band (where no row has much more work
    than the rest here) the last Q tile of each head first."""
    from ringflash.kernels.gluon.launch import _block_args
    from ringflash.kernels.masks import Blocks
    from test_gluon_gpu import _block_mask

    b, s, h = 2, 2048, 4
    n = s // 128
    q = torch.zeros(b, s, h, 128, dtype=torch.bfloat16)
    blocks = Blocks(_block_mask("global", h, s, s))  # block row 1 sees every key block
    order = _block_args(blocks, None, None, q, q, keys_outer=False)[-1].tolist()
    first = [bh * n + 1 for bh in range(b * h)]
    assert order == first + [p for p in range(b * h * n) if p not in first]
    causal = _block_args(blocks, 0, None, q, q, keys_outer=False)[-1].tolist()
    assert causal == [bh * n + t for bh in range(b * h) for t in reversed(range(n))]
    assert len(_block_args(blocks, None, None, q, q, keys_outer=True)) == 5  # the backward: the grid's order


# Dropout (kernels/gluon/dropout.py's ``keep``), each beside its twin without it: alone, under
# the causal band, with GQA, a window and the ring's merge, with segment ids.
DROPOUT_TWINS = {"dropout": "mha", "dropout-causal": "causal", "dropout-gqa-window-add": None,
                 "dropout-documents": "documents"}


@pytest.mark.parametrize("name", list(DROPOUT_TWINS))
def test_dropout_draws_its_bits_in_every_loop(name):
    """With dropout every tile loop of both consumer groups draws its tile's bits (Philox's
    4 calls a thread, 7 rounds; ``keep``'s joins asserted trivial at compile time, no data
    moved: 64 byte compares a thread, and the products among the integer multiplies) and
    applies them to P (64 selects and 64 multiplies), each loop otherwise its twin's without
    dropout (the same wgmmas and exp2); no spills, no serialized wgmma."""
    twin = DROPOUT_TWINS[name]
    kw = dict(VARIANTS[twin] if twin else dict(heads=8, kv_heads=2, causal_offset=0, band_lo=-300,
                                                  accumulate=True, out_dtype=torch.float32))
    missing = [t for t in ("ptxas", "nvdisasm") if not (BIN / t).exists()]
    if missing:
        pytest.skip(f"this triton ships no {', '.join(missing)}")
    from ringflash.kernels.gluon import compile_fwd_sm90
    kernel = compile_fwd_sm90(**kw, dropout=True)
    sass, stderr = assemble(kernel)
    assert "serialized" not in stderr and not re.search(r"C751\d", stderr), stderr
    assert re.search(r"0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", stderr), stderr
    plain = compile_fwd_sm90(**kw)
    loops, plain_loops = _tile_loops(sass), _tile_loops(assemble(plain)[0])
    assert len(loops) == len(plain_loops), ([len(x) for x in loops], [len(x) for x in plain_loops])
    for loop, without in zip(loops, plain_loops):
        more = Counter(loop)
        more.subtract(Counter(without))
        assert more["FSEL"] == 64 and more["FMUL"] == 64 and more["ISETP"] >= 64 and more["IMAD"] >= 32, more
        assert more["HGMMA"] == 0 and more["MUFU"] == 0, more
    assert not re.findall(r"mul\.wide\.u32 \S+, \S+, 0x(?:CD9E8D57|D2511F53);", plain.asm["ptx"])
