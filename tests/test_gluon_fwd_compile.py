"""The Gluon Hopper forward (kernels/gluon/fwd.py) compiled for sm_90 on CPU: no GPU needed.

Checked on each compiled variant (``VARIANTS``: non-causal MHA, the causal band, the
ring's merging step into fp32 sums with GQA, three stages): the scores and P V are wgmmas
of 64 x 128 (8 k-steps each a tile), the partitions keep their register budgets, shared
memory fits an H100's 227 KB, K and V arrive by TMA, ptxas neither serializes the wgmmas
nor spills, every tile loop holds one step's 16 wgmmas and 64 exp2 a thread (and 2 for the
rescale), and the element mask (a selp to -inf) exists in the causal variants only, in a
loop of its own. The argument checks run too. Correctness on a GPU is
tests/test_gluon_fwd_gpu.py's; the compile helpers are tests/test_gluon_compile.py's.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper",
                    reason="this triton has no Gluon Hopper module")

from test_gluon_compile import BIN, H100_SHARED, _ptx_ops, _tile_loops, _tool  # noqa: E402

VARIANTS = {
    "mha": dict(),
    "causal": dict(causal_offset=0),
    "gqa-causal-add": dict(heads=8, kv_heads=2, causal_offset=0, accumulate=True, out_dtype=torch.float32),
    "causal-stages3": dict(causal_offset=-100, stages=3),
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
        with tempfile.TemporaryDirectory() as tmp:
            ptx = Path(tmp) / "fwd.ptx"
            ptx.write_text(kernel.asm["ptx"])
            done = subprocess.run([str(BIN / "ptxas"), "-arch=sm_90a", "-v", str(ptx), "-o",
                                   str(Path(tmp) / "a.cubin")], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        _COMPILED[name] = (kernel, _tool("nvdisasm", kernel.asm["cubin"], "-c"), done.stderr)
    return _COMPILED[name]


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request):
    return (request.param, *_compiled(request.param))


def test_products_loads_and_resources(variant):
    """Per consumer group and loop kind (unmasked; masked, causal only): tile 0's scores (8
    wgmma k-steps) and a step's scores and previous P V (16); then the last P V (8); K and V by 4-D TMA loads;
    12 warps at 168 registers, consumers raised to 240; shared memory within 227 KB."""
    name, kernel, _, _ = variant
    ptx = kernel.asm["ptx"]
    shapes = Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
    loops = 2 if VARIANTS[name].get("causal_offset") is not None else 1
    # two groups x (tile 0's scores, 8, and a step, 16, per loop kind (unmasked, masked), the last P V 8)
    assert shapes == Counter({"m64n128k16": 2 * (24 * loops + 8)}), shapes
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
    """Each tile loop: 16 HGMMA, 66 MUFU (64 exp2 a thread and the rescale's 2); the masked
    loops (causal only, one a group) add 64 FSEL (the -inf selects) and 2 (the max of -inf
    taken as 0); the unmasked ones have none, and stay within 5% of the non-causal loop."""
    name, kernel, sass, _ = variant
    loops = _tile_loops(sass)
    causal = VARIANTS[name].get("causal_offset") is not None
    assert len(loops) == (4 if causal else 2), [len(loop) for loop in loops]
    masked = [loop for loop in loops if "FSEL" in loop]
    assert len(masked) == (2 if causal else 0)
    reference = max(len(loop) for loop in _tile_loops(_compiled("mha")[1]))
    for loop in loops:
        count = Counter(loop)
        assert count["HGMMA"] == 16 and count["MUFU"] == 66, count
        if loop in masked:
            assert count["FSEL"] == 66, count
        else:
            assert len(loop) <= 1.05 * reference, (len(loop), reference)
    assert kernel.asm["ptx"].count("selp.f32") >= (2 * 64 if causal else 0)


def _bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize("change, error, match", [
    (dict(q=_bf16(1, 256, 2, 128).float()), TypeError, "q must be bfloat16"),
    (dict(lse=torch.zeros(1, 2, 256, dtype=torch.float64)), TypeError, "lse must be float32"),
    (dict(out=torch.zeros(1, 256, 2, 128, dtype=torch.int32)), TypeError, "out must be a float tensor"),
    (dict(q=_bf16(1, 256, 2, 64), k=_bf16(1, 256, 2, 64), v=_bf16(1, 256, 2, 64), out=_bf16(1, 256, 2, 64)),
     ValueError, "head_dim must be one of (128,)"),
    (dict(q=_bf16(1, 200, 2, 128), out=_bf16(1, 200, 2, 128), lse=torch.zeros(1, 2, 200)), ValueError,
     "q's seqlen must be a positive multiple of 128"),
    (dict(k=_bf16(1, 256, 3, 128), v=_bf16(1, 256, 3, 128)), ValueError, "k must be (B, Sk, Hkv, D)"),
    (dict(lse=torch.zeros(1, 256, 2)), ValueError, "lse must have shape (1, 2, 256)"),
    (dict(softmax_scale=0.0), ValueError, "softmax_scale must be a positive finite"),
    (dict(causal_offset=0.5), TypeError, "causal_offset must be an int or None"),
    (dict(accumulate=True, out_partial=torch.zeros(1, 2, 256, 128).transpose(1, 2)), ValueError,
     "out_partial must have out's strides"),
    (dict(out_partial=torch.zeros(1, 256, 2, 128)), ValueError, "runs on a Hopper"),  # checks pass, then the device
    (dict(), ValueError, "runs on a Hopper (sm_90) GPU"),
])
def test_argument_checks(change, error, match):
    from ringflash.kernels.gluon import attn_fwd_sm90
    args = dict(q=_bf16(1, 256, 2, 128), k=_bf16(1, 256, 2, 128), v=_bf16(1, 256, 2, 128),
                out=_bf16(1, 256, 2, 128), lse=torch.zeros(1, 2, 256), softmax_scale=0.1, causal_offset=None,
                accumulate=False, out_partial=None)
    args.update(change)
    with pytest.raises(error, match=re.escape(match)):
        attn_fwd_sm90(**args)
