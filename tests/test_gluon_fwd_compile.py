"""The Gluon Hopper forward (kernels/gluon/fwd.py) compiled for sm_90 on CPU: no GPU needed.

Checked on each compiled variant (``VARIANTS``: non-causal MHA, the causal band, the
ring's merging step into fp32 sums with GQA, three stages, head_dim 64, a window's lower
edge): the scores and P V are wgmmas of the expected shapes and counts, the partitions
keep their register budgets, shared memory fits an H100's 227 KB, K and V arrive by TMA,
ptxas neither serializes the wgmmas nor spills, every tile loop holds one step's wgmmas
and 64 exp2 a thread (and 2 for the rescale), and the element mask (a selp to -inf) exists in the banded variants only, in
loops of their own. The argument checks run too. Correctness on a GPU is
tests/test_gluon_fwd_gpu.py's; the compile helpers are tests/test_gluon_compile.py's.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper",
                    reason="this triton has no Gluon Hopper module")

from test_gluon_compile import BIN, H100_SHARED, _ptx_ops, _tile_loops, assemble  # noqa: E402

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
}
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


def test_products_loads_and_resources(variant):
    """Per consumer group: the first tile's scores (head_dim / 16 wgmma k-steps of 64 x 128;
    twice, masked and not, with a band), per loop kind (unmasked, and one masked kind an
    edge of the band) a step's scores and P V (8 of 64 x head_dim), then the last P V; K
    and V by 4-D TMA loads; 12 warps at 168 registers, consumers raised to 240; shared
    memory within 227 KB."""
    name, kernel, _, _ = variant
    ptx = kernel.asm["ptx"]
    shapes = Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
    edges, d = _edges(name), _head_dim(name)
    want = Counter({"m64n128k16": 2 * d // 16 * ((2 if edges else 1) + 1 + edges)})
    want[f"m64n{d}k16"] += 2 * 8 * (1 + edges + 1)
    assert shapes == want, shapes
    ops = _ptx_ops(ptx)
    assert sum(n for op, n in ops.items() if op.startswith("cp.async.bulk.tensor.4d")) >= 4, ops  # Q x 2, K, V
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;", ptx)
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx)
    assert kernel.metadata.num_warps == 12 and kernel.metadata.shared <= H100_SHARED, kernel.metadata.shared


def test_no_serialization_no_spills(variant):
    name, _, sass, stderr = variant
    assert "serialized" not in stderr and not re.search(r"C751\d", stderr), stderr
    assert re.search(r"0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", stderr), stderr


def test_tile_loops_and_the_mask(variant):
    """Each tile loop: 16 HGMMA (12 at head_dim 64), 66 MUFU (64 exp2 a thread and the
    rescale's 2); the masked loops (one a group and edge of the band) add 64 FSEL an edge
    (the -inf selects: each masked step masks by every edge) and 2 (the max of -inf taken as
    0); the unmasked ones have none, and stay within 5% of the unbanded loop of their
    head_dim."""
    name, kernel, sass, _ = variant
    loops = _tile_loops(sass)
    edges = _edges(name)
    assert len(loops) == 2 * (1 + edges), [len(loop) for loop in loops]
    masked = [loop for loop in loops if "FSEL" in loop]
    assert len(masked) == 2 * edges
    plain = "mha" if _head_dim(name) == 128 else "hd64-gqa-add"  # no band
    reference = max(len(loop) for loop in _tile_loops(_compiled(plain)[1]))
    for loop in loops:
        count = Counter(loop)
        assert count["HGMMA"] == _head_dim(name) // 16 + 8 and count["MUFU"] == 66, count
        if loop in masked:
            assert count["FSEL"] == 64 * edges + 2, count
        else:
            assert len(loop) <= 1.05 * reference, (len(loop), reference)
    assert kernel.asm["ptx"].count("selp.f32") >= 2 * 64 * edges


def _bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


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
])
def test_argument_checks(change, error, match):
    from ringflash.kernels.gluon import attn_fwd_sm90
    args = dict(q=_bf16(1, 256, 2, 128), k=_bf16(1, 256, 2, 128), v=_bf16(1, 256, 2, 128),
                out=_bf16(1, 256, 2, 128), lse=torch.zeros(1, 2, 256), softmax_scale=0.1, causal_offset=None,
                accumulate=False, out_partial=None, band_lo=None)
    args.update(change)
    with pytest.raises(error, match=re.escape(match)):
        attn_fwd_sm90(**args)
