"""Single-device kernels against the float64 oracle, on the CPU.

Two implementations of one contract are checked: the PyTorch twin (kernels/reference.py)
and the Triton kernels (kernels/triton/). Without CUDA the Triton kernels run on
CPU tensors through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1);
with CUDA they run compiled, at the same small sizes. The interpreter takes seconds for a
few hundred tokens, so the Triton shapes stay tiny; realistic sizes are in
test_kernels_gpu.py. The interpreter gets bf16 tl.dot wrong, so Triton is checked
here in fp32 and fp16 only; the twin in all three dtypes.

Every output is pre-filled with NaN so that a tile the kernel forgets to write fails.
Errors are relative Frobenius errors against the float64 oracle, and the rule for every
kernel test is: fp32 <= 1e-5, fp16/bf16 <= 2e-2 (oracle.TOL; lse <= 1e-5 whatever the
dtype, oracle.LSE_TOL) and no more than twice torch's own attention
(scaled_dot_product_attention) in the same dtype. CPU SDPA supports fp16 and bf16
directly, so the yardstick is torch's real half-precision kernel, not an upcast.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from oracle import (BF16, DTYPE_ID, F16, F32, LSE_TOL, NOISE_FLOOR, TOL, Case, attention_oracle,
                    oracle_grads, rel_err, torch_attention, visible_mask)

from ringflash.kernels import (PairMask, attn_delta, dispatch, flash_attn, flash_attn_bwd, flash_attn_fwd, op,
                               reference)
from ringflash.kernels import triton as triton_kernels
from ringflash.kernels.triton import config, launch

HAS_CUDA = torch.cuda.is_available()
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"

NAN = float("nan")


def make_inputs(case: Case, dtype, device, seed: int = 0):
    """q, k, v, dout of the case, drawn on the CPU (same numbers on every device)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q = randn(case.b, case.sq, case.h, case.d)
    k = randn(case.b, case.sk, case.hkv, case.d)
    v = randn(case.b, case.sk, case.hkv, case.d)
    dout = randn(case.b, case.sq, case.h, case.d)
    return q, k, v, dout


# ----------------------------------------------------------------------------- implementations


def kernel_module(name: str, monkeypatch):
    """(module with fwd/bwd, device) of an implementation id."""
    if name == "triton":
        return triton_kernels, TRITON_DEVICE
    if name == "triton-gpu-tiles":  # interpreted, with the tile shapes chosen for the GPU
        monkeypatch.setattr(config, "interpreting", lambda: False)
        return triton_kernels, TRITON_DEVICE
    if name == "triton-pointers":  # masked pointer loads instead of TMA descriptors
        monkeypatch.setattr(config, "use_tma", lambda *tensors: False)
        return triton_kernels, TRITON_DEVICE
    if name == "twin-bn16":  # small key tiles: the twin's tile skipping and masking at small sizes
        monkeypatch.setattr(reference, "BLOCK_N", 16)
    return reference, "cpu"


def use_backend(name: str, monkeypatch) -> str:
    """Route flash_attn to one implementation; returns the device to put tensors on."""
    if name == "twin":
        return "cpu"
    if not HAS_CUDA:  # the dispatcher sends CPU tensors to the twin; send them to Triton
        monkeypatch.setattr(dispatch, "backend", lambda t: triton_kernels)
    return TRITON_DEVICE


def run_block(mod, q, k, v, dout, case: Case):
    """Forward then backward of one block pair into NaN-filled buffers (grads in fp32)."""
    b, sq, h, _ = q.shape
    out = torch.full_like(q, NAN)
    lse = torch.full((b, h, sq), NAN, device=q.device)
    mod.fwd(q, k, v, out, lse, softmax_scale=case.softmax_scale, mask=PairMask.causal(case.offset),
            accumulate=False)
    delta = attn_delta(out, dout)
    dq = torch.full(q.shape, NAN, device=q.device)
    dk = torch.full(k.shape, NAN, device=q.device)
    dv = torch.full(v.shape, NAN, device=q.device)
    mod.bwd(dout, q, k, v, lse, delta, dq, dk, dv, softmax_scale=case.softmax_scale,
            mask=PairMask.causal(case.offset), accumulate=False)
    return out, lse, dq, dk, dv


def assert_empty_rows_exact(case: Case, out, lse, dq, dk, dv):
    """Rows that see no key: out 0, lse -inf, dq 0; keys no row sees: dk = dv = 0. Exactly."""
    mask = visible_mask(case.sq, case.sk, case.offset, out.device)
    if mask is None:
        return
    empty_rows, unseen_keys = ~mask.any(dim=1), ~mask.any(dim=0)
    assert (out[:, empty_rows] == 0).all()
    assert torch.isneginf(lse[:, :, empty_rows]).all()
    assert torch.isfinite(lse[:, :, ~empty_rows]).all()
    if dq is not None:
        assert (dq[:, empty_rows] == 0).all()
        assert (dk[:, unseen_keys] == 0).all() and (dv[:, unseen_keys] == 0).all()


def assert_matches_oracle(case: Case, inputs, got, *, dlse=None):
    """got = (out, lse, dq, dk, dv); lse or grads may be None when not produced."""
    q, k, v, dout = inputs
    dtype = q.dtype
    out, lse, dq, dk, dv = got
    ref_out, ref_lse = attention_oracle(q, k, v, case.offset, case.softmax_scale)
    errs = {"out": rel_err(out, ref_out)}
    if lse is not None:
        errs["lse"] = rel_err(lse, ref_lse)
    if dq is not None:
        ref_grads = oracle_grads(q, k, v, dout, case.offset, case.softmax_scale, dlse=dlse)
        errs.update({name: rel_err(g, r) for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads)})
    report = ", ".join(f"{name} {err:.2e}" for name, err in errs.items())
    for name, err in errs.items():
        assert err <= (LSE_TOL if name == "lse" else TOL[dtype]), f"{name}: {report}"
    if dtype != F32 and dlse is None:
        torch_out = torch_attention(q, k, v, dout, case.offset, case.softmax_scale)
        torch_refs = (ref_out,) + (tuple(ref_grads) if dq is not None else ())
        for name, t, r in zip(("out", "dq", "dk", "dv"), torch_out, torch_refs):
            torch_err = rel_err(t, r)
            assert errs[name] <= max(2 * torch_err, NOISE_FLOOR), \
                f"{name}: {errs[name]:.2e} > 2 x torch's {torch_err:.2e} ({report})"
    return errs


# ----------------------------------------------------------------------------- one block pair

BLOCK_CASES = [
    Case(1, 1, 1, 2, 1, 64),              # a single token; MQA
    Case(1, 1, 77, 2, 1, 64, 76),         # one query at the end of its keys (decoding)
    Case(1, 63, 63, 2, 2, 64, 0),         # MHA, causal, odd length
    Case(1, 77, 77, 4, 2, 32, 0),         # GQA, causal
    Case(1, 257, 40, 1, 1, 32),           # many queries, few keys
    Case(1, 40, 257, 1, 1, 32, None, 0.5),  # few queries, many keys, explicit scale
    Case(1, 37, 100, 2, 1, 128, 40),      # positive offset: queries later than the keys
    Case(1, 100, 37, 2, 1, 96, -20),      # negative offset: the first 20 rows see nothing
    Case(1, 50, 64, 2, 1, 64, -60),       # so negative that no row sees a key
    Case(1, 64, 64, 2, 1, 64, -1),        # the stripe layout's offset: row 0 sees nothing
    Case(1, 40, 70, 2, 1, 64, 100),       # offset past every key: the mask changes nothing
    Case(1, 48, 48, 2, 1, 256, 0),        # the largest head_dim
    Case(1, 16, 300, 2, 1, 32, 250),      # queries at the end of a long key block: tile skipping
    Case(2, 33, 47, 2, 1, 64, 5, 1.0),    # batch 2
]
LARGE_CASES = [  # too slow for the interpreter
    Case(1, 600, 600, 2, 1, 64, 0),       # several of the twin's default 256-key tiles
    Case(2, 300, 520, 4, 2, 128, 200),
]
GPU_TILE_CASES = [  # a few tiles of each GPU config: head_dim <= 64, <= 128, 256
    Case(1, 200, 150, 2, 1, 64, 0),
    Case(1, 130, 200, 2, 1, 128, 60),
    Case(1, 100, 70, 1, 1, 256, -10),
]


# The interpreter takes seconds a case: fp16 there (its casts, and the 2x-torch rule) on the
# cases whose masks differ (GQA causal, empty rows, queries after their keys, the largest
# head_dim, batch 2); every mask and shape runs in fp32, and the twin runs all in every dtype.
def _block_cases(*ids):
    cases = {c.id: c for c in BLOCK_CASES}
    return [cases[i] for i in ids]


INTERPRETER_F16_CASES = _block_cases(
    "b1-q1-k77-h2kv1-d64-causal+76", "b1-q77-k77-h4kv2-d32-causal+0", "b1-q37-k100-h2kv1-d128-causal+40",
    "b1-q100-k37-h2kv1-d96-causal-20", "b1-q48-k48-h2kv1-d256-causal+0", "b2-q33-k47-h2kv1-d64-causal+5-scale1")
# Masked pointer loads instead of TMA descriptors: rows and head_dim past the tensors' ends
# (a single row, head_dim 96 of a 128-wide tile, 256, ragged batch 2).
POINTER_CASES = _block_cases("b1-q1-k77-h2kv1-d64-causal+76", "b1-q100-k37-h2kv1-d96-causal-20",
                             "b1-q48-k48-h2kv1-d256-causal+0", "b2-q33-k47-h2kv1-d64-causal+5-scale1")


def block_params():
    """Which implementation runs which cases, in which dtypes. "triton-gpu-tiles" interprets
    the kernels with the tile shapes they use on a GPU (fp32 only: it is about tile logic)."""
    combos = [("twin", BLOCK_CASES + LARGE_CASES, (F32, F16, BF16)),
              ("twin-bn16", BLOCK_CASES, (F32, F16, BF16))]
    if HAS_CUDA:
        combos += [("triton", BLOCK_CASES + LARGE_CASES + GPU_TILE_CASES, (F32, F16)),
                   ("triton-pointers", BLOCK_CASES + GPU_TILE_CASES, (F16,))]
    else:
        combos += [("triton", BLOCK_CASES, (F32,)), ("triton", INTERPRETER_F16_CASES, (F16,)),
                   ("triton-pointers", POINTER_CASES, (F16,)), ("triton-gpu-tiles", GPU_TILE_CASES, (F32,))]
    return [pytest.param(kernel, dtype, c, id=f"{kernel}-{DTYPE_ID[dtype]}-{c.id}")
            for kernel, cases, dtypes in combos for dtype in dtypes for c in cases]


@pytest.mark.parametrize("kernel,dtype,case", block_params())
def test_block_matches_oracle(kernel, dtype, case, monkeypatch):
    mod, device = kernel_module(kernel, monkeypatch)
    inputs = make_inputs(case, dtype, device)
    out, lse, dq, dk, dv = got = run_block(mod, *inputs, case)
    assert out.dtype == dtype and lse.dtype == F32
    assert_empty_rows_exact(case, out, lse, dq, dk, dv)
    assert_matches_oracle(case, inputs, got)


# ----------------------------------------------------------------------------- accumulate

SPLIT_CASES = [  # (case, first key of the second part)
    (Case(1, 40, 70, 2, 1, 64), 30),
    (Case(1, 64, 64, 2, 1, 32, 0), 32),    # the second part is invisible to rows 0..31
    (Case(1, 50, 50, 2, 1, 64, -10), 20),  # rows 0..9 see neither part, 10..29 only the first
]


@pytest.mark.parametrize("order", ["ascending", "descending"])
@pytest.mark.parametrize("case,split", SPLIT_CASES, ids=[f"{c.id}-split{s}" for c, s in SPLIT_CASES])
@pytest.mark.parametrize("kernel,dtype", [pytest.param(k, d, id=f"{k}-{DTYPE_ID[d]}")
                                          for k, d in (("twin", F32), ("twin", F16), ("triton", F32))])
def test_split_keys_accumulate(kernel, dtype, case, split, order, monkeypatch):
    """The ring's use: merge partials over key ranges into a running (out, lse) that starts
    at (0, -inf), then add each range's gradients into buffers that already hold some.
    (The running sums are fp32 whatever the inputs: Triton's fp16 inputs are checked
    without accumulating, test_block_matches_oracle.)"""
    mod, device = kernel_module(kernel, monkeypatch)
    q, k, v, dout = make_inputs(case, dtype, device)
    parts = [(0, split), (split, case.sk)]
    if order == "descending":
        parts.reverse()

    def part_offset(start):
        return None if case.offset is None else case.offset - start

    out = torch.zeros(q.shape, device=device)  # the running out stays fp32
    lse = torch.full((case.b, case.h, case.sq), -math.inf, device=device)
    for start, end in parts:
        mod.fwd(q, k[:, start:end], v[:, start:end], out, lse, softmax_scale=case.softmax_scale,
                mask=PairMask.causal(part_offset(start)), accumulate=True)

    delta = attn_delta(out, dout)
    gen = torch.Generator().manual_seed(1)
    before = [torch.randn(t.shape, generator=gen).to(device) for t in (q, k, v)]
    dq, dk, dv = (t.clone() for t in before)
    for start, end in parts:
        mod.bwd(dout, q, k[:, start:end], v[:, start:end], lse, delta, dq, dk[:, start:end],
                dv[:, start:end], softmax_scale=case.softmax_scale, mask=PairMask.causal(part_offset(start)),
                accumulate=True)
    added = tuple(g - b for g, b in zip((dq, dk, dv), before))

    ref_out, ref_lse = attention_oracle(q, k, v, case.offset, case.softmax_scale)
    assert_empty_rows_exact(case, out, lse, None, None, None)
    assert rel_err(lse, ref_lse) <= LSE_TOL
    assert rel_err(out, ref_out) <= TOL[dtype]
    ref_grads = oracle_grads(q, k, v, dout, case.offset, case.softmax_scale)
    for name, g, r in zip(("dq", "dk", "dv"), added, ref_grads):
        assert rel_err(g, r) <= TOL[dtype], name


@pytest.mark.parametrize("kernel", ["twin", "triton"])
def test_backward_passes_run_apart(kernel, monkeypatch):
    """dq alone, then dk and dv alone (the ring's order), give the bits of one joint call."""
    mod, device = kernel_module(kernel, monkeypatch)
    case = Case(1, 45, 70, 4, 2, 32, 10)
    q, k, v, dout = make_inputs(case, F32, device)
    out, lse = torch.empty_like(q), torch.empty((1, 4, 45), device=device)
    mod.fwd(q, k, v, out, lse, softmax_scale=case.softmax_scale, mask=PairMask.causal(10), accumulate=False)
    delta = attn_delta(out, dout)
    joint = [torch.full(t.shape, NAN, device=device) for t in (q, k, v)]
    mod.bwd(dout, q, k, v, lse, delta, *joint, softmax_scale=case.softmax_scale, mask=PairMask.causal(10),
            accumulate=False)
    apart = [torch.full(t.shape, NAN, device=device) for t in (q, k, v)]
    mod.bwd(dout, q, k, v, lse, delta, apart[0], None, None, softmax_scale=case.softmax_scale,
            mask=PairMask.causal(10), accumulate=False)
    assert apart[1].isnan().all()
    mod.bwd(dout, q, k, v, lse, delta, None, apart[1], apart[2], softmax_scale=case.softmax_scale,
            mask=PairMask.causal(10), accumulate=False)
    for a, j in zip(apart, joint):
        assert torch.equal(a, j)


@pytest.mark.parametrize("kernel", ["twin", "triton"])
@pytest.mark.parametrize("mask", ["blocks", "dropout", "causal"])
def test_backward_reads_a_sequence_joined_from_two_tensors(kernel, mask, monkeypatch):
    """k and v (dQ pass), q and dout (dK/dV pass) given as ``Joined``, each part a separate
    tensor, under a per-head block mask, with dropout or a causal band (partial blocks in
    both parts): the same bits as the whole tensors. Without a block mask it raises.
    (The interpreter is slow: a batch of two under the block mask alone, where the parts'
    batch strides are read; grouped query heads with their own masks under the band.)"""
    from ringflash.kernels import Joined
    from ringflash.kernels.block_sparse import random_block_mask
    from ringflash.kernels.masks import Blocks
    device = use_backend("twin" if kernel == "twin" else "triton", monkeypatch)
    heads = 2 if mask == "causal" else 1
    case = Case(2 if mask == "blocks" else 1, 256, 256, heads, 1, 16, None)
    q, k, v, dout = make_inputs(case, F32, device)
    blocks = Blocks(random_block_mask(256, 0.5, heads=heads, seed=2, device=device))
    pair = {"blocks": PairMask(blocks=blocks),
            "dropout": PairMask(dropout_p=0.3, seed=5, pos=(0, 0, 1, 0), blocks=blocks),
            "causal": PairMask(band_hi=0, blocks=blocks)}[mask]
    lse = torch.rand((case.b, heads, 256), device=device) + 4
    delta = torch.randn((case.b, heads, 256), device=device)
    whole = [torch.full(t.shape, NAN, device=device) for t in (q, k, v)]
    flash_attn_bwd(dout, q, k, v, lse, delta, *whole, softmax_scale=0.3, mask=pair)

    def joined(t):  # rows [0, 128) and [128, 256), apart in memory
        return Joined(t[:, :128].clone(), t[:, 128:].clone())
    dq = torch.full(q.shape, NAN, device=device)
    flash_attn_bwd(dout, q, joined(k), joined(v), lse, delta, dq, None, None, softmax_scale=0.3, mask=pair)
    dk, dv = (torch.full(t.shape, NAN, device=device) for t in (k, v))
    flash_attn_bwd(joined(dout), joined(q), k, v, lse, delta, None, dk, dv, softmax_scale=0.3, mask=pair)
    for got, want in zip((dq, dk, dv), whole):
        assert torch.equal(got, want)
    if mask == "blocks":  # a batch of one: a view into a longer sequence joined to a tensor of
        one = [t[:1] for t in (q, k, v, dout)]  # its own (batch strides differ, and are unused)
        want = torch.full(one[0].shape, NAN, device=device)
        flash_attn_bwd(one[3], one[0], one[1], one[2], lse[:1], delta[:1], want, None, None,
                       softmax_scale=0.3, mask=pair)
        got = torch.full(one[0].shape, NAN, device=device)
        apart = [torch.empty(t[:, 128:].shape, device=device).copy_(t[:, 128:]) for t in one[1:3]]
        flash_attn_bwd(one[3], one[0], *(Joined(t[:, :128], u) for t, u in zip(one[1:3], apart)),
                       lse[:1], delta[:1], got, None, None, softmax_scale=0.3, mask=pair)
        assert torch.equal(got, want)
        with pytest.raises(ValueError, match="share strides"):  # batch rows of unequal length
            flash_attn_bwd(dout, q, Joined(k[:, :128].clone(), k[:, 128:192].clone()),
                           Joined(v[:, :128].clone(), v[:, 128:192].clone()), lse, delta, dq, None, None,
                           softmax_scale=0.3, mask=pair)
    with pytest.raises(ValueError, match="needs a block mask"):
        flash_attn_bwd(dout, q, joined(k), joined(v), lse, delta, dq, None, None, softmax_scale=0.3)
    with pytest.raises(ValueError, match="dq=None"):
        flash_attn_bwd(joined(dout), joined(q), k, v, lse, delta, dq, dk, dv, softmax_scale=0.3, mask=pair)
    with pytest.raises(ValueError, match="both be Joined"):
        flash_attn_bwd(dout, q, joined(k), v, lse, delta, dq, None, None, softmax_scale=0.3, mask=pair)
    with pytest.raises(ValueError, match="multiple of 128"):
        flash_attn_bwd(dout, q, Joined(k[:1, :100], k[:1, 100:200]), Joined(v[:1, :100], v[:1, 100:200]),
                       lse, delta, dq, None, None, softmax_scale=0.3, mask=pair)


@pytest.mark.parametrize("kernel", ["twin", "triton"])
@pytest.mark.parametrize("mask", ["blocks", "dropout", "causal"])
def test_forward_reads_a_sequence_joined_from_two_tensors(kernel, mask, monkeypatch):
    """k and v given as ``Joined`` under a per-head block mask, with dropout or a causal
    band: the same bits as the whole tensors when the parts run in order, and the same
    result up to rounding when the second part runs first (``Arrival(last=0)``, as a ring
    of two's rank 1 runs its own keys first). Bad arrivals raise."""
    from ringflash.kernels import Arrival, Joined
    from ringflash.kernels.block_sparse import random_block_mask
    from ringflash.kernels.masks import Blocks
    device = use_backend("twin" if kernel == "twin" else "triton", monkeypatch)
    # A batch of two under the block mask alone (the parts' batch strides); grouped query
    # heads with their own masks under the band.
    heads = 2 if mask == "causal" else 1
    q, k, v, _ = make_inputs(Case(2 if mask == "blocks" else 1, 128, 256, heads, 1, 16, None), F32, device)
    blocks = Blocks(random_block_mask(256, 0.5, heads=heads, seed=3, device=device)[:, :1])
    pair = {"blocks": PairMask(blocks=blocks),
            "dropout": PairMask(dropout_p=0.3, seed=5, pos=(0, 0, 1, 0), blocks=blocks),
            "causal": PairMask(band_hi=128, blocks=blocks)}[mask]
    want = flash_attn_fwd(q, k, v, softmax_scale=0.3, mask=pair)

    def joined(t):  # rows [0, 128) and [128, 256), apart in memory
        return Joined(t[:, :128].clone(), t[:, 128:].clone())
    got = flash_attn_fwd(q, joined(k), joined(v), softmax_scale=0.3, mask=pair)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    got = flash_attn_fwd(q, joined(k), joined(v), softmax_scale=0.3, mask=pair, arrival=Arrival(0))
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="needs a block mask"):
        flash_attn_fwd(q, joined(k), joined(v), softmax_scale=0.3)
    with pytest.raises(ValueError, match="for a Joined"):
        flash_attn_fwd(q, k, v, softmax_scale=0.3, mask=pair, arrival=Arrival(1))
    with pytest.raises(ValueError, match="last must be 0 or 1"):
        flash_attn_fwd(q, joined(k), joined(v), softmax_scale=0.3, mask=pair, arrival=Arrival(2))
    flags = torch.zeros(2, dtype=torch.int32, device=device)  # one flag too many; off CUDA, flags at all
    with pytest.raises(ValueError, match="int32 tensor of 1" if q.is_cuda else "needs the Triton kernel"):
        flash_attn_fwd(q, joined(k), joined(v), softmax_scale=0.3, mask=pair, arrival=Arrival(1, flags, 1, 1))


@pytest.mark.parametrize("kernel", ["twin", "triton"])
def test_accumulate_into_empty_state_is_plain_forward(kernel, monkeypatch):
    """Merging one block into (out 0, lse -inf) gives exactly what accumulate=False gives."""
    mod, device = kernel_module(kernel, monkeypatch)
    case = Case(1, 45, 33, 2, 1, 64, 3)
    q, k, v, _ = make_inputs(case, F32, device)
    out = torch.zeros_like(q)
    lse = torch.full((1, 2, 45), -math.inf, device=device)
    mod.fwd(q, k, v, out, lse, softmax_scale=case.softmax_scale, mask=PairMask.causal(3), accumulate=True)
    plain_out, plain_lse = torch.full_like(q, NAN), torch.full_like(lse, NAN)
    mod.fwd(q, k, v, plain_out, plain_lse, softmax_scale=case.softmax_scale, mask=PairMask.causal(3),
            accumulate=False)
    assert rel_err(out, plain_out) <= 1e-6 and rel_err(lse, plain_lse) <= 1e-6


@pytest.mark.parametrize("kernel", ["twin", "triton"])
def test_accumulating_from_partials_writes_the_cast_sums(kernel, monkeypatch):
    """The ring's last passes: merged with fp32 running sums given apart (out_partial, the
    grads' partials) and written in bf16, the bits equal accumulating into the fp32 sums
    and casting them. (Triton's interpreter rounds fp32 to bf16 toward zero, not to
    nearest as the GPU and torch do: there, within one bf16 step.)"""
    mod, device = kernel_module(kernel, monkeypatch)

    def same(got, want):
        if kernel == "twin" or device != "cpu":
            return torch.equal(got, want.to(BF16))
        return bool(((got.float() - want).abs() <= want.abs() * 2 ** -7).all())

    case = Case(1, 45, 70, 4, 2, 32, 10)
    q, k, v, dout = make_inputs(case, F32, device)
    kw = dict(softmax_scale=case.softmax_scale, mask=PairMask.causal(10))
    gen = torch.Generator().manual_seed(8)
    out0 = torch.randn(q.shape, generator=gen).to(device)
    lse0 = torch.randn((1, 4, 45), generator=gen).to(device)
    out, lse = out0.clone(), lse0.clone()
    mod.fwd(q, k, v, out, lse, accumulate=True, **kw)
    final, lse_final = torch.full(q.shape, NAN, device=device).to(BF16), lse0.clone()
    mod.fwd(q, k, v, final, lse_final, accumulate=True, out_partial=out0, **kw)
    assert same(final, out) and torch.equal(lse_final, lse)
    delta = attn_delta(out, dout)
    sums = [torch.randn(t.shape, generator=gen).to(device) for t in (q, k, v)]
    summed = [t.clone() for t in sums]
    mod.bwd(dout, q, k, v, lse, delta, *summed, accumulate=True, **kw)
    grads = [torch.full(t.shape, NAN, device=device).to(BF16) for t in (q, k, v)]
    mod.bwd(dout, q, k, v, lse, delta, *grads, accumulate=True, partials=tuple(sums), **kw)
    for g, want in zip(grads, summed):
        assert same(g, want)


def test_partials_need_accumulate_and_the_layout():
    case = Case(1, 30, 30, 2, 2, 16, 0)
    q, k, v, dout = make_inputs(case, F32, "cpu")
    out, lse = flash_attn_fwd(q, k, v, softmax_scale=1.0)
    with pytest.raises(ValueError, match="out_partial needs accumulate"):
        flash_attn_fwd(q, k, v, softmax_scale=1.0, out=out, lse=lse, out_partial=out.clone())
    with pytest.raises(ValueError, match="out_partial must have out's shape"):
        flash_attn_fwd(q, k, v, softmax_scale=1.0, out=out, lse=lse, accumulate=True,
                       out_partial=out.transpose(1, 2).contiguous().transpose(1, 2))
    delta = attn_delta(out, dout)
    dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
    with pytest.raises(ValueError, match="dk_partial must have dk's shape"):
        flash_attn_bwd(dout, q, k, v, lse, delta, dq, dk, dv, softmax_scale=1.0, accumulate=True,
                       dk_partial=dk[:, :10])


@pytest.mark.parametrize("device", ["cpu", TRITON_DEVICE], ids=["twin", "triton"])
def test_bwd_adds_dq_and_writes_dkv(device):
    """accumulate=True, accumulate_dkv=False: dQ added into the running dq, dK and dV
    written over whatever dk and dv held (NaN here), every key row of the pair, zeros for
    keys no query sees: equal to adding into zeroed sums."""
    case = Case(1, 45, 70, 4, 2, 32, 10)
    q, k, v, dout = make_inputs(case, F32, device)
    kw = dict(softmax_scale=case.softmax_scale, mask=PairMask.causal(-20))  # keys 26.. unseen
    out, lse = flash_attn_fwd(q, k, v, **kw)
    delta = attn_delta(out, dout)
    running = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(device)
    dq, dk, dv = running.clone(), torch.full_like(k, NAN), torch.full_like(v, NAN)
    flash_attn_bwd(dout, q, k, v, lse, delta, dq, dk, dv, accumulate=True, accumulate_dkv=False, **kw)
    want = [running.clone(), torch.zeros_like(k), torch.zeros_like(v)]
    flash_attn_bwd(dout, q, k, v, lse, delta, *want, accumulate=True, **kw)
    for got, expected in zip((dq, dk, dv), want):
        assert not got.isnan().any() and torch.equal(got, expected)
    assert (dk[:, 26:] == 0).all() and (dk[:, :26] != 0).any()


def test_accumulate_dkv_is_checked():
    case = Case(1, 30, 30, 2, 2, 16, 0)
    q, k, v, dout = make_inputs(case, F32, "cpu")
    out, lse = flash_attn_fwd(q, k, v, softmax_scale=1.0)
    delta = attn_delta(out, dout)
    dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
    with pytest.raises(ValueError, match="accumulate_dkv=True needs accumulate=True"):
        flash_attn_bwd(dout, q, k, v, lse, delta, dq, dk, dv, softmax_scale=1.0, accumulate_dkv=True)
    with pytest.raises(ValueError, match="no dk_partial"):
        flash_attn_bwd(dout, q, k, v, lse, delta, dq, dk, dv, softmax_scale=1.0, accumulate=True,
                       accumulate_dkv=False, dk_partial=dk.clone(), dv_partial=dv.clone())
    with pytest.raises(TypeError, match="accumulate_dkv must be a bool"):
        flash_attn_bwd(dout, q, k, v, lse, delta, dq, dk, dv, softmax_scale=1.0, accumulate=True,
                       accumulate_dkv=0)


@pytest.mark.parametrize("rows,cols", [(2, 5000), (4, 16384 + 3), (1, 1)])
def test_add_rounded_matches_torch(rows, cols):
    """kernels.add_rounded (the ring's last dK/dV sums) on (P, m) views whose rows lie apart
    in memory: the twin is torch's add into bf16, and the Triton kernel equals it (Triton's
    interpreter rounds toward zero: there, within one bf16 step)."""
    from ringflash.kernels import add_rounded
    gen = torch.Generator().manual_seed(rows + cols)
    a, b = (torch.randn(rows, cols + 7, generator=gen)[:, 3:cols + 3] for _ in range(2))
    want = torch.empty(rows, cols, dtype=BF16)
    torch.add(a, b, out=want)
    for run, device in ((add_rounded, "cpu"), (triton_kernels.add_rounded, TRITON_DEVICE)):
        out = torch.full((rows, 2 * cols), NAN, dtype=BF16, device=device)[:, cols // 2:cols // 2 + cols]
        run(out, a.to(device), b.to(device))
        got = out.cpu()
        if run is add_rounded or HAS_CUDA:
            assert torch.equal(got, want)
        else:
            assert bool(((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7).all())
    with pytest.raises(ValueError, match="one shape"):
        add_rounded(want, a, b[:, 1:])
    wide = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="contiguous"):
        add_rounded(wide.t(), wide.t(), wide.t())


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_delta_kernel_matches_twin(dtype):
    """The backward's delta = rowsum(dout * out) in one Triton pass equals the twin's fp32
    products, on strided views and a head_dim that is not a power of two."""
    gen = torch.Generator().manual_seed(3)
    out = torch.randn(2, 37, 3, 2, 40, generator=gen).to(TRITON_DEVICE, dtype)[:, :, 1]
    dout = torch.randn(2, 37, 2, 48, generator=gen).to(TRITON_DEVICE, dtype)[..., :40]
    got = triton_kernels.delta(out, dout)
    want = reference.delta(out, dout)
    assert got.shape == (2, 2, 37) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_launches_share_one_stand_in_for_unused_pointers():
    """A launch without segment ids or a block mask passes one kept stand-in for their
    pointers (no allocation and fill kernel per launch), and a launch with them passes theirs."""
    device = torch.device(TRITON_DEVICE)
    qseg, kseg = launch._segment_ids(PairMask(), device)
    lists = launch._lists(PairMask(), launch._band(PairMask()), 8, 8, False, device, (16, 1, 1, 1))
    assert qseg is kseg is lists.counts is lists.index is lists.order is launch._stand_in(device)
    ids = torch.zeros(1, 8, dtype=torch.int32, device=device)
    qseg, _ = launch._segment_ids(PairMask(q_segments=ids, k_segments=ids), device)
    assert qseg is ids


@pytest.mark.parametrize("kernel", ["twin", "triton"])
def test_strided_views(kernel, monkeypatch):
    """Inputs sliced out of a packed qkv tensor; outputs written into views of larger buffers."""
    mod, device = kernel_module(kernel, monkeypatch)
    case = Case(2, 45, 45, 2, 2, 32, 0)
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 45, 3, 2, 32, generator=gen).to(device)
    q, k, v = qkv.unbind(dim=2)
    dout = torch.randn(2, 45, 2, 32, generator=gen).to(device)
    assert not q.is_contiguous()
    out_buf = torch.full((2, 45, 2, 48), NAN, device=device)
    lse_buf = torch.full((2, 2, 50), NAN, device=device)
    out, lse = out_buf[..., :32], lse_buf[..., 3:48]
    mod.fwd(q, k, v, out, lse, softmax_scale=case.softmax_scale, mask=PairMask.causal(0), accumulate=False)
    grad_buf = torch.full((2, 45, 3, 2, 40), NAN, device=device)
    dq, dk, dv = grad_buf[..., :32].unbind(dim=2)
    mod.bwd(dout, q, k, v, lse, attn_delta(out, dout), dq, dk, dv,
            softmax_scale=case.softmax_scale, mask=PairMask.causal(0), accumulate=False)
    assert_matches_oracle(case, (q, k, v, dout), (out, lse, dq, dk, dv))
    # Nothing outside the views was touched.
    assert out_buf[..., 32:].isnan().all() and lse_buf[..., :3].isnan().all()
    assert lse_buf[..., 48:].isnan().all() and grad_buf[..., 32:].isnan().all()


def test_block_entry_points_on_cpu():
    """flash_attn_fwd / attn_delta / flash_attn_bwd, as the ring calls them on CPU tensors."""
    case = Case(1, 30, 50, 4, 2, 32, 20)
    q, k, v, dout = make_inputs(case, F32, "cpu")
    out, lse = flash_attn_fwd(q, k, v, softmax_scale=case.softmax_scale, causal_offset=20)
    assert out.shape == q.shape and out.dtype == F32
    assert lse.shape == (1, 4, 30) and lse.dtype == F32
    dlse = torch.randn(1, 4, 30)
    delta = attn_delta(out, dout, dlse)
    assert torch.allclose(delta, (out * dout).sum(-1).transpose(1, 2) - dlse, atol=1e-5)
    dq, dk, dv = (torch.full(t.shape, NAN) for t in (q, k, v))
    flash_attn_bwd(dout, q, k, v, lse, delta, dq, dk, dv, softmax_scale=case.softmax_scale,
                   causal_offset=20)
    assert_matches_oracle(case, (q, k, v, dout), (out, lse, dq, dk, dv), dlse=dlse)
    with pytest.raises(ValueError, match="accumulate"):
        flash_attn_fwd(q, k, v, softmax_scale=1.0, accumulate=True)
    with pytest.raises(ValueError, match="dk and dv"):
        flash_attn_bwd(dout, q, k, v, lse, delta, dq, dk, None, softmax_scale=1.0)


@pytest.mark.parametrize("impl", ["twin", "triton"])
def test_one_query_row(impl, monkeypatch):
    """seqlen_q = 1 (a decoding step) through flash_attn's backward: lse and delta then have a
    last dimension of one element, whose stride is anything (the twin's delta used to be
    refused as not contiguous)."""
    if impl == "triton" and not HAS_CUDA:
        monkeypatch.setattr(dispatch, "backend", lambda t: triton_kernels)
    device = TRITON_DEVICE if impl == "triton" else "cpu"
    case = Case(1, 1, 37, 4, 2, 16)
    q, k, v, dout = (t.requires_grad_() for t in make_inputs(case, F32, device))
    out, lse = flash_attn(q, k, v, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_matches_oracle(case, (q.detach(), k.detach(), v.detach(), dout), (out.detach(), lse.detach(), *grads))


def test_cpu_autocast_leaves_the_twin_in_its_dtype():
    """The twin computes as the Triton kernels do, in q's dtype with fp32 sums, whatever
    torch.autocast("cpu") says: inside a bf16 autocast region fp32 inputs give the same bits
    (the einsums were downcast to bf16 before, errors ~1e-2)."""
    case = Case(1, 40, 40, 2, 1, 32, 0)
    q, k, v, dout = (t.requires_grad_() for t in make_inputs(case, F32, "cpu"))

    def run():
        out = flash_attn(q, k, v, causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))
    want = run()
    with torch.autocast("cpu", dtype=BF16):
        got = run()
    assert got[0].dtype == F32
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- the differentiable op

OP_CASES = [  # (case, causal); causal means offset 0, top-left aligned
    (Case(1, 77, 77, 4, 2, 64, 0), True),
    (Case(2, 37, 80, 2, 1, 32, 0), True),   # fewer queries than keys
    (Case(1, 80, 37, 2, 2, 128, 0), True),  # more queries than keys
    (Case(1, 65, 65, 2, 1, 96), False),
]
OP_DTYPES = {"twin": (F32, F16, BF16), "triton": (F32, F16)}


def op_params():
    return [pytest.param(backend, dt, case, causal, id=f"{backend}-{DTYPE_ID[dt]}-{case.id}")
            for backend in ("twin", "triton") for dt in OP_DTYPES[backend] for case, causal in OP_CASES]


def leaf_inputs(case, dtype, device):
    q, k, v, dout = make_inputs(case, dtype, device)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout


@pytest.mark.parametrize("backend,dtype,case,causal", op_params())
def test_flash_attn_matches_oracle(backend, dtype, case, causal, monkeypatch):
    device = use_backend(backend, monkeypatch)
    q, k, v, dout = leaf_inputs(case, dtype, device)
    out = flash_attn(q, k, v, causal=causal)
    out.backward(dout)
    assert out.dtype == dtype and out.shape == q.shape
    for t in (q, k, v):
        assert t.grad.dtype == dtype and t.grad.shape == t.shape
    assert_matches_oracle(case, (q, k, v, dout), (out, None, q.grad, k.grad, v.grad))


@pytest.mark.parametrize("backend,dtype", [pytest.param(b, d, id=f"{b}-{DTYPE_ID[d]}")
                                           for b in ("twin", "triton") for d in (F32, F16)])
def test_flash_attn_lse_gradient(backend, dtype, monkeypatch):
    """return_lse: lse (B, H, Sq) fp32, and a loss that uses lse gets the oracle's gradient."""
    device = use_backend(backend, monkeypatch)
    case = Case(1, 70, 50, 2, 1, 64, 0)
    q, k, v, dout = leaf_inputs(case, dtype, device)
    dlse = torch.randn(1, 2, 70, generator=torch.Generator().manual_seed(2)).to(device)
    out, lse = flash_attn(q, k, v, causal=True, return_lse=True)
    assert lse.shape == (1, 2, 70) and lse.dtype == F32
    ((out.float() * dout.float()).sum() + (lse * dlse).sum()).backward()
    assert_matches_oracle(case, (q, k, v, dout), (out, lse, q.grad, k.grad, v.grad), dlse=dlse)


@pytest.mark.parametrize("backend", ["twin", "triton"])
@pytest.mark.parametrize("sq,sk", [(20, 50), (50, 20)], ids=["q20-k50", "q50-k20"])
def test_causal_is_top_left_like_sdpa(backend, sq, sk, monkeypatch):
    device = use_backend(backend, monkeypatch)
    case = Case(1, sq, sk, 2, 2, 32, 0)
    q, k, v, dout = leaf_inputs(case, F32, device)
    out = flash_attn(q, k, v, causal=True)
    expected = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True).transpose(1, 2)
    assert rel_err(out, expected) <= 1e-5
    assert rel_err(out, attention_oracle(q, k, v, 0)[0]) <= 1e-5


@pytest.mark.parametrize("backend", ["twin", "triton"])
def test_flash_attn_heads_major_layout(backend, monkeypatch):
    """q, k, v, dout living in (B, H, S, D) memory order, as a model that transposes hands them over."""
    device = use_backend(backend, monkeypatch)
    gen = torch.Generator().manual_seed(0)

    def heads_major(b, h, s, d):
        return torch.randn(b, h, s, d, generator=gen).to(device).transpose(1, 2)

    q = heads_major(1, 4, 40, 32).requires_grad_()
    k, v = heads_major(1, 2, 40, 32).requires_grad_(), heads_major(1, 2, 40, 32).requires_grad_()
    dout = heads_major(1, 4, 40, 32)
    out = flash_attn(q, k, v, causal=True, softmax_scale=0.25)
    out.backward(dout)
    case = Case(1, 40, 40, 4, 2, 32, 0, 0.25)
    assert_matches_oracle(case, (q, k, v, dout), (out, None, q.grad, k.grad, v.grad))


@pytest.mark.parametrize("backend", ["twin", "triton"])
def test_flash_attn_non_unit_last_stride(backend, monkeypatch):
    """q and k whose last dimension is not contiguous (the op must copy them, and its outputs
    must still come out right)."""
    device = use_backend(backend, monkeypatch)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 32, 40, generator=gen).to(device).permute(0, 3, 1, 2).requires_grad_()
    k = torch.randn(1, 2, 32, 40, generator=gen).to(device).permute(0, 3, 1, 2).requires_grad_()
    v = torch.randn(1, 40, 2, 32, generator=gen).to(device).requires_grad_()
    dout = torch.randn(1, 40, 4, 32, generator=gen).to(device)
    assert q.stride(-1) != 1 and k.stride(-1) != 1
    out = flash_attn(q, k, v, causal=True)
    out.backward(dout)
    case = Case(1, 40, 40, 4, 2, 32, 0)
    assert_matches_oracle(case, (q, k, v, dout), (out, None, q.grad, k.grad, v.grad))


def test_flash_attn_integer_scale():
    case = Case(1, 20, 20, 2, 1, 16, None, 1)
    q, k, v, dout = leaf_inputs(case, F32, "cpu")
    out = flash_attn(q, k, v, softmax_scale=1)
    out.backward(dout)
    assert_matches_oracle(case, (q, k, v, dout), (out, None, q.grad, k.grad, v.grad))


def test_torch_compile_traces_the_op():
    """fullgraph tracing through the custom ops and their fake kernels (aot_eager: no codegen)."""
    case = Case(1, 24, 24, 2, 1, 16, 0)
    q, k, v, dout = leaf_inputs(case, F32, "cpu")
    compiled = torch.compile(lambda q, k, v: flash_attn(q, k, v, causal=True, return_lse=True),
                             backend="aot_eager", fullgraph=True)
    out, lse = compiled(q, k, v)
    out.backward(dout)
    assert_matches_oracle(case, (q, k, v, dout), (out, lse, q.grad, k.grad, v.grad))


def test_forward_route_rules(monkeypatch):
    """kernels/dispatch.py's forward route, read on CPU stand-ins of a Hopper call: the
    twin off CUDA; on sm_90 the Gluon forward only for no mask, a band on local indices,
    segment ids and a block mask (not both), k and v whole, head_dim 128, bf16 (the
    stand-ins pass every rule but the device); dropout on Triton."""
    from ringflash.kernels.dispatch import Route, fwd_route

    def call(sq=256, d=128, dtype=torch.bfloat16, out=torch.bfloat16, **kwargs):
        q = torch.zeros(1, sq, 4, d, dtype=dtype)
        k = torch.zeros(1, 256, 2, d, dtype=dtype)
        options = {**dict(softmax_scale=0.1, mask=PairMask.causal(0), accumulate=False), **kwargs}
        return fwd_route(q, k, k, torch.zeros(q.shape, dtype=out), torch.zeros(1, 4, sq), **options)

    device = "attn_fwd_sm90: q is on cpu; this kernel runs on a Hopper (sm_90) GPU"
    assert call() == Route("reference")
    monkeypatch.setattr(dispatch, "capability", lambda t: (9, 0))
    assert call().why == device
    assert call(mask=PairMask()).why == device  # no mask
    assert call(accumulate=True, out=torch.float32).why == device  # the ring's running out
    assert call(accumulate=True, out_partial=torch.zeros(1, 256, 4, 128)).why == device  # the ring's last step
    assert "out_partial is read only with accumulate=True" in call(out_partial=torch.zeros(1, 256, 4, 128)).why
    seg = torch.zeros(1, 256, dtype=torch.int32)
    for mask in (PairMask(band_lo=-64, band_hi=0), PairMask(band_lo=-64),  # windows
                 PairMask(q_segments=seg, k_segments=seg), PairMask(band_hi=0, q_segments=seg, k_segments=seg)):
        assert call(mask=mask).why == device, mask
    assert "k_segments must be int32" in call(mask=PairMask(q_segments=seg, k_segments=seg.long())).why
    assert "k_segments must have shape (1, 256)" in call(mask=PairMask(q_segments=seg, k_segments=seg[:, :128])).why
    # a block mask (block-sparse): one for every head or one a query head, with or without a band
    from ringflash.kernels.masks import Blocks
    for blocks in (torch.ones(1, 2, 2, dtype=torch.bool), torch.rand(4, 2, 2) < 0.5):
        for mask in (PairMask(blocks=Blocks(blocks)), PairMask(band_lo=-64, band_hi=0, blocks=Blocks(blocks))):
            assert call(mask=mask).why == device, mask
    assert "blocks.mask must be (1 or heads, 2, 2)" in call(mask=PairMask(blocks=Blocks(torch.ones(2, 2, 2).bool()))).why
    assert "blocks must be a kernels.masks.Blocks" in call(mask=PairMask(blocks=object())).why
    for mask in (PairMask(band_hi=0, band_on_positions=True),
                 PairMask(q_segments=seg, k_segments=seg, blocks=Blocks(torch.ones(1, 2, 2, dtype=torch.bool)))):
        assert call(mask=mask).why == dispatch.MASK_WHY, mask
    # dropout: the Triton forward (the Gluon forward takes it, measured slower: kernels/dispatch.py)
    for mask in (PairMask(dropout_p=0.1, pos=(0, 0, 1, 0)), PairMask(band_hi=0, dropout_p=0.1, pos=(4096, 128, 1, 384)),
                 PairMask(q_segments=seg, k_segments=seg, dropout_p=0.1, pos=(16, 32, 1, 0))):
        assert call(mask=mask).why == dispatch.DROPOUT_WHY, mask
    assert call(tail=(None, None)).why == "k, v Joined from two tensors"
    assert call(d=64).why == "head_dim 64: the Gluon forward is routed at 128 (level with Triton at 64)"
    assert "must be bfloat16" in call(dtype=torch.float16).why
    assert "multiple of 128" in call(sq=200).why
    assert "out_partial must have out's strides" in call(
        accumulate=True, out_partial=torch.zeros(1, 4, 256, 128).transpose(1, 2)).why
    monkeypatch.setattr(dispatch, "capability", lambda t: (8, 0))
    assert call() == Route("triton", "sm_80, not sm_90")


def test_backward_route_rules(monkeypatch):
    """kernels/dispatch.py's backward route, read on CPU stand-ins of a Hopper call: the
    twin off CUDA; on sm_90 the Gluon kernel only where it serves the call, else the
    Triton kernels with the reason (the stand-ins pass every rule but the device)."""
    from ringflash.kernels.dispatch import Route, bwd_route

    def call(sq=256, d=128, dtype=torch.bfloat16, dq=torch.float32, dkv=None, **kwargs):
        q = torch.zeros(1, sq, 4, d, dtype=dtype)
        k = torch.zeros(1, 256, 2, d, dtype=dtype)
        lse = torch.zeros(1, 4, sq)
        options = {**dict(softmax_scale=0.1, mask=PairMask.causal(0), accumulate=False), **kwargs}
        grads = (torch.zeros(k.shape, dtype=dkv or dtype) for _ in range(2))
        return bwd_route(q, q, k, k, lse, lse, None if dq is None else torch.zeros(q.shape, dtype=dq), *grads,
                         **options)

    assert call() == Route("reference")
    monkeypatch.setattr(dispatch, "capability", lambda t: (9, 0))
    assert call().why == "attn_bwd_sm90: q is on cpu; this kernel runs on a Hopper (sm_90) GPU"
    assert call(mask=PairMask()).why == call().why  # no mask
    torch.use_deterministic_algorithms(True)  # the same route: the Gluon kernel then adds dQ in a fixed order
    try:
        assert call().why == "attn_bwd_sm90: q is on cpu; this kernel runs on a Hopper (sm_90) GPU"
    finally:
        torch.use_deterministic_algorithms(False)
    for mask in (PairMask(band_lo=-64, band_hi=0), PairMask(band_lo=-64)):  # windows (deterministic too)
        assert call(mask=mask).why == call().why, mask
    seg = torch.zeros(1, 256, dtype=torch.int32)
    for mask in (PairMask(q_segments=seg, k_segments=seg), PairMask(band_hi=0, q_segments=seg, k_segments=seg),
                 PairMask(band_lo=-64, band_hi=0, q_segments=seg, k_segments=seg)):  # packed documents
        assert call(mask=mask).why == call().why, mask
        # not deterministic: the Triton backward serves that (and repeats its bits)
        assert "deterministic with segment ids is not served" in call(mask=mask, deterministic=True).why
        torch.use_deterministic_algorithms(True)
        try:
            assert "deterministic with segment ids is not served" in call(mask=mask).why
        finally:
            torch.use_deterministic_algorithms(False)
    assert "q_segments must have shape (1, 256)" in call(mask=PairMask(q_segments=seg[:, :64], k_segments=seg)).why
    # a block mask (block-sparse): one for every head or one a query head, with or without a band
    from ringflash.kernels.masks import Blocks
    for blocks in (torch.ones(1, 2, 2, dtype=torch.bool), torch.rand(4, 2, 2) < 0.5):
        for mask in (PairMask(blocks=Blocks(blocks)), PairMask(band_lo=-64, band_hi=0, blocks=Blocks(blocks))):
            assert call(mask=mask).why == call().why, mask
            assert "blocks with deterministic is not served" in call(mask=mask, deterministic=True).why
    wrong = PairMask(blocks=Blocks(torch.ones(2, 2, 2).bool()))
    assert "blocks.mask must be (1 or heads, 2, 2)" in call(mask=wrong).why
    assert "blocks.mask must be bool" in call(mask=PairMask(blocks=Blocks(torch.ones(1, 2, 2)))).why
    assert "blocks must be a kernels.masks.Blocks" in call(mask=PairMask(blocks=object())).why
    for mask in (PairMask(band_hi=0, band_on_positions=True),
                 PairMask(q_segments=seg, k_segments=seg, blocks=Blocks(torch.ones(1, 2, 2, dtype=torch.bool)))):
        assert call(mask=mask).why == dispatch.MASK_WHY, mask
    # dropout: positions of stride 1 aligned to its bits' blocks, with any mask but a block mask, not deterministic
    for mask in (PairMask(dropout_p=0.1, pos=(0, 0, 1, 0)), PairMask(band_hi=0, dropout_p=0.1, pos=(4096, 128, 1, 384)),
                 PairMask(q_segments=seg, k_segments=seg, dropout_p=0.1, pos=(16, 32, 1, 0))):
        assert call(mask=mask).why == call().why, mask
        assert "dropout with deterministic is not served" in call(mask=mask, deterministic=True).why
    assert "needs pos with stride 1, q0 a multiple of 16" in call(mask=PairMask(dropout_p=0.1, pos=(8, 0, 1, 0))).why
    assert "k0 and jump of 32" in call(mask=PairMask(dropout_p=0.1, pos=(0, 16, 1, 0))).why
    for mask in (PairMask(dropout_p=0.1, pos=(0, 1, 2, 0)),  # stripe's stride: the Triton kernels
                 PairMask(dropout_p=0.1, pos=(0, 0, 1, 0), blocks=Blocks(torch.ones(1, 2, 2, dtype=torch.bool)))):
        assert call(mask=mask).why == dispatch.DROPOUT_WHY, mask
    assert "together" in call(dq=None).why
    # the ring's steps: dq, dk and dv added into fp32 sums, not *_partial ones
    assert call(accumulate=True, dkv=torch.float32).why == call().why
    assert call(dkv=torch.float32).why == call().why  # fp32 dk, dv written
    assert "dk must be torch.float32 (accumulate adds into fp32 sums)" in call(accumulate=True).why
    assert "fp32 sums only" in call(accumulate=True, dkv=torch.float32, dq=torch.bfloat16).why
    assert "*_partial" in call(accumulate=True, partials=(torch.zeros(1), None, None)).why
    assert call(d=64).why == call().why
    assert call(d=96).why == "head_dim 96: the Gluon kernel serves 64 and 128"
    assert "must be bfloat16" in call(dtype=torch.float16).why
    assert "multiple of 128" in call(sq=200).why
    # the ring's schedule choice (dispatch.gluon_serves) follows the same rules
    q, k = torch.zeros(1, 256, 4, 128, dtype=torch.bfloat16), torch.zeros(1, 256, 2, 128, dtype=torch.bfloat16)
    docs = PairMask(band_hi=0, q_segments=seg, k_segments=seg)
    assert dispatch.gluon_serves(q, k, 256, 256, docs) and dispatch.gluon_serves(q, k, 256, 256, PairMask(), True)
    assert not dispatch.gluon_serves(q, k, 256, 256, docs, True)
    dropped = PairMask(band_hi=0, dropout_p=0.1, pos=(0, 0, 1, 0))
    assert dispatch.gluon_serves(q, k, 256, 256, dropped) and not dispatch.gluon_serves(q, k, 256, 256, dropped, True)
    assert not dispatch.gluon_serves(q, k, 256, 256, dropped._replace(pos=(0, 0, 4, 0)))
    assert not dispatch.gluon_serves(q, k, 256, 200, docs)
    assert not dispatch.gluon_serves(q, k, 256, 256, PairMask(dropout_p=0.1))
    monkeypatch.setattr(dispatch, "capability", lambda t: (8, 0))
    assert call() == Route("triton", "sm_80, not sm_90")
    assert not dispatch.gluon_serves(q, k, 256, 256, PairMask())


@pytest.mark.parametrize("backend", ["twin", "triton"])
@pytest.mark.parametrize("uses", ["out", "lse", "both"])
def test_eager_calls_skip_the_custom_ops_and_agree_with_them(backend, uses, monkeypatch):
    """Outside torch.compile flash_attn runs its implementations through a plain
    autograd.Function: the custom ops are not called, and out, lse and every gradient equal
    the ops' path bit for bit, whichever of out and lse the loss uses (an unused one's
    gradient arrives as None) -- and match the oracle."""
    device = use_backend(backend, monkeypatch)
    case = Case(1, 70, 50, 2, 1, 64, 0)
    gen = torch.Generator().manual_seed(2)
    dlse = torch.randn(1, 2, 70, generator=gen).to(device) * (uses != "out")
    q, k, v, dout = leaf_inputs(case, F32, device)
    dout = dout * (uses != "lse")

    def run():
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out, lse = flash_attn(qq, kk, vv, causal=True, return_lse=True)
        loss = {"out": (out * dout).sum(), "lse": (lse * dlse).sum(),
                "both": (out * dout).sum() + (lse * dlse).sum()}[uses]
        loss.backward()
        return out.detach(), lse.detach(), qq.grad, kk.grad, vv.grad

    def refuse(*args, **kwargs):
        raise AssertionError("an eager call reached a custom op")

    with monkeypatch.context() as patched:
        patched.setattr(op, "_forward_op", refuse)
        patched.setattr(op, "_backward_op", refuse)
        eager = run()
    monkeypatch.setattr(op, "eager", lambda *tensors: False)
    through_ops = run()
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), eager, through_ops):
        assert torch.equal(a, b), name
    assert_matches_oracle(case, (q, k, v, dout), eager, dlse=dlse)


def test_eager_is_off_under_compile_and_fake_tensors():
    """torch.compile and fake-tensor tracing (make_fx, opcheck) see the custom ops."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    t = torch.zeros(1, 4, 2, 16)
    assert op.eager(t, None)
    with FakeTensorMode():
        assert not op.eager(torch.zeros(1, 4, 2, 16))
    seen = []

    def traced(x):
        seen.append(op.eager(x))
        return x * 2

    torch.compile(traced, backend="eager", fullgraph=True)(t)
    assert seen == [False]


# ----------------------------------------------------------------------------- bad input


def _t(*shape, dtype=F32, device="cpu"):
    return torch.zeros(*shape, dtype=dtype, device=device)


Q, KV = (1, 8, 2, 16), (1, 8, 1, 16)
BAD_INPUTS = [  # id, (q, k, v), kwargs, exception, the argument the message must name
    ("q-not-a-tensor", lambda: ([[0.0]], _t(*KV), _t(*KV)), {}, TypeError, r"\bq\b"),
    ("q-3d", lambda: (_t(8, 2, 16), _t(*KV), _t(*KV)), {}, ValueError, r"\bq\b"),
    ("k-5d", lambda: (_t(*Q), _t(1, *KV), _t(*KV)), {}, ValueError, r"\bk\b"),
    ("v-2d", lambda: (_t(*Q), _t(*KV), _t(8, 16)), {}, ValueError, r"\bv\b"),
    ("q-int32", lambda: (_t(*Q, dtype=torch.int32), _t(*KV), _t(*KV)), {}, TypeError, r"\bq\b"),
    ("v-float64", lambda: (_t(*Q), _t(*KV), _t(*KV, dtype=torch.float64)), {}, TypeError, r"\bv\b"),
    ("mixed-dtypes", lambda: (_t(*Q), _t(*KV, dtype=F16), _t(*KV)), {}, TypeError, "q, k and v"),
    ("mixed-devices", lambda: (_t(*Q), _t(*KV, device="meta"), _t(*KV)), {}, ValueError, "q, k and v"),
    ("k-v-shapes-differ", lambda: (_t(*Q), _t(*KV), _t(1, 9, 1, 16)), {}, ValueError, r"\bk and v\b"),
    ("batch-differs", lambda: (_t(2, 8, 2, 16), _t(*KV), _t(*KV)), {}, ValueError, r"\bbatch\b"),
    ("head-dims-differ", lambda: (_t(*Q), _t(1, 8, 1, 32), _t(1, 8, 1, 32)), {}, ValueError, r"\bhead_dim\b"),
    ("heads-not-multiple-of-kv-heads", lambda: (_t(1, 8, 3, 16), _t(1, 8, 2, 16), _t(1, 8, 2, 16)), {},
     ValueError, r"\bheads\b"),
    ("zero-kv-heads", lambda: (_t(*Q), _t(1, 8, 0, 16), _t(1, 8, 0, 16)), {}, ValueError, r"\bheads\b"),
    ("head_dim-over-256", lambda: (_t(1, 8, 2, 264), _t(1, 8, 1, 264), _t(1, 8, 1, 264)), {},
     ValueError, r"\bhead_dim\b"),
    ("batch-0", lambda: (_t(0, 8, 2, 16), _t(0, 8, 1, 16), _t(0, 8, 1, 16)), {}, ValueError, r"\bbatch\b"),
    ("seqlen_q-0", lambda: (_t(1, 0, 2, 16), _t(*KV), _t(*KV)), {}, ValueError, r"\bseqlen\b"),
    ("seqlen_k-0", lambda: (_t(*Q), _t(1, 0, 1, 16), _t(1, 0, 1, 16)), {}, ValueError, r"\bseqlen\b"),
    ("scale-str", lambda: (_t(*Q), _t(*KV), _t(*KV)), {"softmax_scale": "0.1"}, TypeError, r"\bsoftmax_scale\b"),
    ("scale-bool", lambda: (_t(*Q), _t(*KV), _t(*KV)), {"softmax_scale": True}, TypeError, r"\bsoftmax_scale\b"),
    ("scale-tensor", lambda: (_t(*Q), _t(*KV), _t(*KV)), {"softmax_scale": torch.tensor(0.1)}, TypeError,
     r"\bsoftmax_scale\b"),
    ("scale-inf", lambda: (_t(*Q), _t(*KV), _t(*KV)), {"softmax_scale": math.inf}, ValueError, r"\bsoftmax_scale\b"),
    ("scale-nan", lambda: (_t(*Q), _t(*KV), _t(*KV)), {"softmax_scale": NAN}, ValueError, r"\bsoftmax_scale\b"),
    ("scale-zero", lambda: (_t(*Q), _t(*KV), _t(*KV)), {"softmax_scale": 0.0}, ValueError, r"\bsoftmax_scale\b"),
    ("scale-negative", lambda: (_t(*Q), _t(*KV), _t(*KV)), {"softmax_scale": -0.1}, ValueError,
     r"\bsoftmax_scale\b"),
    ("causal-int", lambda: (_t(*Q), _t(*KV), _t(*KV)), {"causal": 1}, TypeError, r"\bcausal\b"),
    ("causal-str", lambda: (_t(*Q), _t(*KV), _t(*KV)), {"causal": "true"}, TypeError, r"\bcausal\b"),
    ("causal-none", lambda: (_t(*Q), _t(*KV), _t(*KV)), {"causal": None}, TypeError, r"\bcausal\b"),
]


@pytest.mark.parametrize("make,kwargs,exc,name", [pytest.param(*b[1:], id=b[0]) for b in BAD_INPUTS])
def test_bad_input_raises_naming_the_argument(make, kwargs, exc, name):
    with pytest.raises(exc, match=name):
        flash_attn(*make(), **kwargs)


def _views_past_2_31(batch_stride: int, names_heads: dict, seqlen: int, head_dim: int):
    """(B = 3, seqlen, heads, head_dim) fp16 views, one per name, inside one storage of
    3 * batch_stride elements: batch b of every view starts at b * batch_stride, so batch 2
    lies past element 2**31 while the batch stride itself fits 32 bits (the product
    overflowed in 32-bit offsets). Only the rows the views cover are ever written, so the
    6.4 GB storage takes ~no memory (its pages are never touched)."""
    rows = torch.empty(3 * batch_stride, dtype=F16).view(3, batch_stride)
    views, at = {}, 0
    for name, heads in names_heads.items():
        n = seqlen * heads * head_dim
        views[name] = rows[:, at:at + n].view(3, seqlen, heads, head_dim)
        at += n
    return views


def test_tensors_past_2_31_elements():
    """Offsets past 2**31 elements: the kernels (forward, merging forward, delta, dK/dV, dQ;
    GQA) read and write a batch that starts past element 2**31 of its tensor's storage, and
    give bit for bit what they give on compact copies. With 32-bit offsets batch 2's
    offset wrapped (a crash, or other memory read)."""
    s, d = 64, 16
    t = _views_past_2_31(2 ** 30 + 2 ** 20, dict(q=2, k=1, v=1, o=2, do=2, dq=2, dk=1, dv=1, acc=2), s, d)
    g = torch.Generator().manual_seed(0)
    for name in ("q", "k", "v", "do", "acc"):
        t[name].copy_(torch.randn(t[name].shape, generator=g).to(F16))
    assert t["q"].storage_offset() + 2 * t["q"].stride(0) > 2 ** 31
    compact = {name: x.clone() for name, x in t.items()}
    results = []
    for x in (t, compact):
        lse = torch.randn(3, 2, s, generator=torch.Generator().manual_seed(1))
        kw = dict(softmax_scale=0.25, mask=PairMask(band_hi=0))  # causal
        triton_kernels.fwd(x["q"], x["k"], x["v"], x["o"], lse, accumulate=False, **kw)
        triton_kernels.fwd(x["q"], x["k"], x["v"], x["acc"], lse, accumulate=True, **kw)  # merges into acc
        delta = launch.delta(x["o"], x["do"])
        triton_kernels.bwd(x["do"], x["q"], x["k"], x["v"], lse, delta, x["dq"], x["dk"], x["dv"],
                           accumulate=False, **kw)
        results.append([lse, delta] + [x[name] for name in ("o", "acc", "dq", "dk", "dv")])
    for name, big, small in zip(("lse", "delta", "o", "acc", "dq", "dk", "dv"), *results):
        assert torch.equal(big, small), name


def test_offsets_check_on_meta_tensors():
    """The launcher's offset rule without memory (meta tensors): any size passes (q of
    (80, 8192, 32, 128), 2.7e9 elements, and a view spanning past 2**31), while a row stride
    whose 256-row tile would pass 2**31 elements raises, naming the tensor."""
    big = torch.empty(80, 8192, 32, 128, device="meta", dtype=F16)
    assert launch._check_offsets(q=big, k=big[:, :, :1], lse=torch.empty(80, 32, 8192, device="meta"))
    assert not launch._check_offsets(q=big[:64], lse=torch.empty(64, 32, 8192, device="meta"))  # 2**31: fits
    wide = torch.empty(2, 4, 2 ** 24, device="meta", dtype=F16)[..., :128].view(2, 4, 1, 128)
    with pytest.raises(ValueError, match=r"^k \(shape .*row stride below 2\*\*23"):
        launch._check_offsets(k=wide)
    launch._check_offsets(k=torch.empty(2, 4, 2 ** 31, device="meta", dtype=F16)[..., :128].view(2, 4, 1, 128))
