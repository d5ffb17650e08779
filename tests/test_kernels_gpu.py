"""The Triton kernels, compiled, at realistic sizes on one GPU (skipped without CUDA).

Same yardsticks as tests/test_kernels.py: the float64 oracle of tests/oracle.py (run on
the GPU), relative Frobenius errors, fp32 <= 1e-5 (IEEE dots, torch's default of no
TF32), TF32 <= 1e-3, fp16/bf16 <= 2e-2 and no more than twice the error of torch's own
scaled_dot_product_attention in the same dtype. Outputs are pre-filled with NaN.
Sizes stay moderate (the oracle holds a few float64 score matrices of up to 8k x 8k);
most of the file's time is Triton compiling its variants.
"""

import math

import pytest
import torch
from oracle import (BF16, DTYPE_ID, F16, F32, LSE_TOL, NOISE_FLOOR, TOL, Case, attention_oracle,
                    oracle_grads, rel_err, torch_attention, visible_mask)

from ringflash.kernels import PairMask, attn_delta, flash_attn
from ringflash.kernels import triton as triton_kernels

pytestmark = pytest.mark.gpu

TF32_TOL = 1e-3
NAN = float("nan")


def make_inputs(case: Case, dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    return (randn(case.b, case.sq, case.h, case.d), randn(case.b, case.sk, case.hkv, case.d),
            randn(case.b, case.sk, case.hkv, case.d), randn(case.b, case.sq, case.h, case.d))


def run_block(case: Case, q, k, v, dout):
    """Triton forward and backward of one block pair into NaN-filled buffers (grads fp32)."""
    out = torch.full_like(q, NAN)
    lse = torch.full((case.b, case.h, case.sq), NAN, device="cuda")
    triton_kernels.fwd(q, k, v, out, lse, softmax_scale=case.softmax_scale, mask=PairMask.causal(case.offset),
                    accumulate=False)
    dq = torch.full(q.shape, NAN, device="cuda")
    dk = torch.full(k.shape, NAN, device="cuda")
    dv = torch.full(v.shape, NAN, device="cuda")
    triton_kernels.bwd(dout, q, k, v, lse, attn_delta(out, dout), dq, dk, dv, softmax_scale=case.softmax_scale,
                    mask=PairMask.causal(case.offset), accumulate=False)
    return out, lse, dq, dk, dv


def check(case: Case, inputs, got, *, tol=None, lse_tol=LSE_TOL, dlse=None):
    """Compare (out, lse, dq, dk, dv) with the oracle, and half types with torch's SDPA."""
    q, k, v, dout = inputs
    out, lse, dq, dk, dv = got
    tol = TOL[q.dtype] if tol is None else tol
    ref_out, ref_lse = attention_oracle(q, k, v, case.offset, case.softmax_scale)
    ref_grads = oracle_grads(q, k, v, dout, case.offset, case.softmax_scale, dlse=dlse)
    errs = {"out": rel_err(out, ref_out)}
    if lse is not None:
        errs["lse"] = rel_err(lse, ref_lse)
    errs.update(zip(("dq", "dk", "dv"), (rel_err(g, r) for g, r in zip((dq, dk, dv), ref_grads))))
    report = ", ".join(f"{name} {err:.2e}" for name, err in errs.items())
    for name, err in errs.items():
        assert err <= (lse_tol if name == "lse" else tol), f"{name}: {report}"
    if q.dtype != F32 and dlse is None:
        for name, t, r in zip(("out", "dq", "dk", "dv"),
                              torch_attention(q, k, v, dout, case.offset, case.softmax_scale),
                              (ref_out,) + tuple(ref_grads)):
            torch_err = rel_err(t, r)
            assert errs[name] <= max(2 * torch_err, NOISE_FLOOR), \
                f"{name}: {errs[name]:.2e} > 2 x torch's {torch_err:.2e} ({report})"

    mask = visible_mask(case.sq, case.sk, case.offset, "cuda")
    if mask is not None:  # rows that see nothing: exactly 0 / -inf, never NaN
        empty_rows, unseen_keys = ~mask.any(dim=1), ~mask.any(dim=0)
        assert (out[:, empty_rows] == 0).all() and (dq[:, empty_rows] == 0).all()
        if lse is not None:
            assert torch.isneginf(lse[:, :, empty_rows]).all()
        assert (dk[:, unseen_keys] == 0).all() and (dv[:, unseen_keys] == 0).all()


BF16_CASES = [
    Case(2, 1024, 1024, 8, 8, 64),            # MHA, no mask
    Case(1, 1000, 1000, 16, 4, 128, 0),       # GQA, causal, odd length
    Case(1, 4097, 4097, 8, 2, 128, 0),        # odd length past 4k
    Case(1, 2048, 4096, 8, 1, 128, 2048),     # MQA; queries are the second half of the keys
    Case(1, 4096, 2048, 4, 2, 64, -1024),     # the first 1024 rows see nothing
    Case(1, 1536, 1536, 4, 1, 256, 0),        # the largest head_dim
    Case(1, 8192, 8192, 4, 1, 64, 0),         # 8k causal
    Case(1, 3000, 3000, 4, 2, 96, -1),        # the stripe layout's offset; head_dim not a power of 2
]
FP16_CASES = [BF16_CASES[i] for i in (1, 2, 5, 7)]
FP32_CASES = [
    Case(1, 1000, 1000, 4, 2, 64, 0),
    Case(1, 1024, 777, 2, 1, 256, 100),
]
BLOCK_PARAMS = [pytest.param(dt, c, id=f"{DTYPE_ID[dt]}-{c.id}")
                for dt, cases in ((BF16, BF16_CASES), (F16, FP16_CASES), (F32, FP32_CASES)) for c in cases]


@pytest.mark.parametrize("dtype,case", BLOCK_PARAMS)
def test_triton_block_matches_oracle(dtype, case):
    inputs = make_inputs(case, dtype)
    got = run_block(case, *inputs)
    assert got[0].dtype == dtype and got[1].dtype == F32
    check(case, inputs, got)


def test_triton_tf32(monkeypatch):
    """fp32 inputs with torch's TF32 switch on: the kernels' dots follow it."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    case = Case(1, 2000, 2000, 4, 2, 128, 0)
    inputs = make_inputs(case, F32)
    # TF32 rounds q and k before the scores, so lse is only as good as the rest.
    check(case, inputs, run_block(case, *inputs), tol=TF32_TOL, lse_tol=TF32_TOL)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case,causal", [(Case(2, 2048, 2048, 16, 4, 128, 0), True),
                                         (Case(1, 1000, 3000, 8, 8, 64), False)],
                         ids=["b2-q2048-h16kv4-d128-causal", "b1-q1000-k3000-h8-d64-full"])
def test_flash_attn_op(dtype, case, causal):
    """The differentiable op end to end; gradients come back in the inputs' dtype."""
    q, k, v, dout = make_inputs(case, dtype)
    for t in (q, k, v):
        t.requires_grad_()
    out, lse = flash_attn(q, k, v, causal=causal, return_lse=True)
    out.backward(dout)
    assert q.grad.dtype == dtype
    check(case, (q, k, v, dout), (out, lse, q.grad, k.grad, v.grad))


def test_flash_attn_lse_gradient():
    case = Case(1, 1500, 1500, 8, 2, 128, 0)
    q, k, v, dout = make_inputs(case, BF16)
    for t in (q, k, v):
        t.requires_grad_()
    dlse = torch.randn(1, 8, 1500, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    out, lse = flash_attn(q, k, v, causal=True, return_lse=True)
    ((out.float() * dout.float()).sum() + (lse * dlse).sum()).backward()
    check(case, (q, k, v, dout), (out, lse, q.grad, k.grad, v.grad), dlse=dlse)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_ring_like_accumulation(dtype):
    """What a rank does in a causal ring: its 1024 queries (global rows 3072..4095) against
    four visiting 1024-key shards, own shard first, merged into an fp32 running (out, lse)
    from (0, -inf); then each shard's gradients added into views of fp32 buffers that
    already hold something."""
    case = Case(1, 1024, 4096, 8, 2, 128, 3072)
    q, k, v, dout = make_inputs(case, dtype)
    shards = [(s, s + 1024) for s in (3072, 2048, 1024, 0)]
    out = torch.zeros(q.shape, device="cuda")
    lse = torch.full((1, 8, 1024), -math.inf, device="cuda")
    for start, end in shards:
        triton_kernels.fwd(q, k[:, start:end], v[:, start:end], out, lse, softmax_scale=case.softmax_scale,
                        mask=PairMask.causal(case.offset - start), accumulate=True)
    delta = attn_delta(out.to(dtype), dout)
    gen = torch.Generator(device="cuda").manual_seed(1)
    before = [torch.randn(t.shape, generator=gen, device="cuda") for t in (q, k, v)]
    dq, dk, dv = (t.clone() for t in before)
    for start, end in shards:
        triton_kernels.bwd(dout, q, k[:, start:end], v[:, start:end], lse, delta, dq, dk[:, start:end],
                        dv[:, start:end], softmax_scale=case.softmax_scale,
                        mask=PairMask.causal(case.offset - start), accumulate=True)
    added = [g - b for g, b in zip((dq, dk, dv), before)]
    check(case, (q, k, v, dout), (out.to(dtype), lse, *added))


def _hopper() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


def _backward_twice(case: Case, **kwargs) -> list:
    """[out, dq, dk, dv] of two identical flash_attn calls."""
    q, k, v, dout = make_inputs(case, BF16)
    runs = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = flash_attn(*leaves, **kwargs)
        out.backward(dout)
        runs.append([out.detach()] + [t.grad for t in leaves])
    return runs


@pytest.mark.parametrize("masked", [True, False], ids=["masked", "causal"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_backward_bits_repeat(deterministic, masked):
    """The same bits twice: with deterministic=True always, and by default on the Triton
    route (causal with a block mask and segment ids: every gradient written once, no
    atomics). The default's plain causal call takes the Gluon backward on Hopper, whose dQ
    adds tiles in arrival order: there only out, dK and dV must repeat, and dQ matches the
    oracle (test_flash_attn_op). GQA, bf16, 4k tokens."""
    from ringflash.kernels import block_sparse
    kwargs = dict(causal=True, deterministic=deterministic)
    if masked:
        lengths = torch.tensor([1000, 24, 2000, 1072])
        kwargs["segment_ids"] = torch.repeat_interleave(torch.arange(4), lengths)[None].cuda()
        kwargs["block_mask"] = block_sparse.random_block_mask(4096, 0.6, heads=8, seed=2, device="cuda")
    runs = _backward_twice(Case(1, 4096, 4096, 8, 2, 128), **kwargs)
    stable = ("out", "dk", "dv") if not (deterministic or masked) and _hopper() else ("out", "dq", "dk", "dv")
    for name, a, b in zip(("out", "dq", "dk", "dv"), *runs):
        if name in stable:
            assert torch.equal(a, b), f"{name} differs between two identical runs"


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_default_backward_takes_the_gluon_kernel_on_hopper(causal, monkeypatch):
    """On sm_90, flash_attn's default backward of a bf16 head_dim-128 call runs the Gluon
    kernel (kernels/dispatch.py) and matches the oracle (the yardsticks of ``check``);
    deterministic=True runs it too, in its fixed order of dQ adds, to the same yardsticks."""
    if not _hopper():
        pytest.skip("the Gluon backward needs an sm_90 (Hopper) GPU")
    from ringflash.kernels import dispatch
    calls, run = [], dispatch.gluon_bwd

    def counted(*args, **kwargs):
        calls.append(1)
        run(*args, **kwargs)

    monkeypatch.setattr(dispatch, "gluon_bwd", counted)
    case = Case(2, 1024, 1024, 8, 2, 128, 0 if causal else None)
    q, k, v, dout = make_inputs(case, BF16)
    for t in (q, k, v):
        t.requires_grad_()
    out, lse = flash_attn(q, k, v, causal=causal, return_lse=True)
    out.backward(dout)
    assert calls == [1]
    check(case, (q, k, v, dout), (out, lse, q.grad, k.grad, v.grad))
    for t in (q, k, v):
        t.grad = None
    out = flash_attn(q, k, v, causal=causal, deterministic=True)
    out.backward(dout)
    assert calls == [1, 1]
    check(case, (q, k, v, dout), (out, lse, q.grad, k.grad, v.grad))


def test_forward_waits_for_a_part_still_arriving():
    """``Arrival`` with flags: the second part of the keys lands (host to device copies on
    a side stream, behind a sleep that is on the GPU before the launch) after the forward
    has started, then its flags; every query tile waits for its head's chunk, so the result
    is that of the whole tensors. Without the wait the tiles would read the zeros the part
    starts as."""
    from ringflash.kernels import Arrival, Joined, flash_attn_fwd
    from ringflash.kernels.block_sparse import random_block_mask
    from ringflash.kernels.masks import Blocks
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, 1024, 8, 64, device=dev, dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    k, v = k[:, :, :4].contiguous(), v[:, :, :4].contiguous()  # 4 K/V heads, GQA
    mask = PairMask(blocks=Blocks(random_block_mask(1024, 0.5, heads=8, seed=1, device=dev)))
    want = flash_attn_fwd(q, k, v, softmax_scale=0.125, mask=mask)
    host = [t[:, 512:].cpu().pin_memory() for t in (k, v)]
    parts = [torch.zeros_like(t[:, 512:]) for t in (k, v)]
    flags = torch.zeros(2, dtype=torch.int32, device=dev)  # two chunks of 2 K/V heads
    landed = torch.full((2,), 7, dtype=torch.int32).pin_memory()
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: the forward starts first
        for part, src in zip(parts, host):
            part.copy_(src, non_blocking=True)
        flags.copy_(landed, non_blocking=True)
    got = flash_attn_fwd(q, Joined(k[:, :512], parts[0]), Joined(v[:, :512], parts[1]),
                         softmax_scale=0.125, mask=mask, arrival=Arrival(1, flags, 7, 2))
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _past_2_31_masks(b: int, s: int):
    gen = torch.Generator().manual_seed(2)
    lengths = torch.randint(1, 3 * s // 8, (b, 16), generator=gen).cumsum(1)
    ids = (torch.arange(s)[None, None, :] >= lengths[:, :, None]).sum(1).to(torch.int32).cuda()  # (b, s)
    return {"causal": dict(causal=True), "documents": dict(causal=True, segment_ids=ids),
            "window": dict(causal=True, window_size=(1024, 0)),
            "sparse": dict(block_mask=torch.rand(1, s // 128, s // 128, generator=gen).cuda() < 0.3)}


@pytest.mark.parametrize("kv_heads,mask", [(32, "causal"), (8, "causal"), (8, "documents"), (8, "window"),
                                           (8, "sparse")])
def test_tensors_past_2_31_elements(kv_heads, mask):
    """q, out, dout, dq of (80, 8192, 32, 128) bf16: 2.7e9 elements each, batches 64-79
    past element 2**31 (with 32-bit offsets: an illegal memory access). The forward and
    backward of batches on both sides of the line equal, bit for bit, the kernels run on
    those batches alone (dQ within 1e-4: on Hopper the causal calls take the Gluon
    backward, whose dQ adds in arrival order), and the causal ones match torch's SDPA
    there (bf16 tolerance)."""
    b, s, h, d = 80, 8192, 32, 128
    torch.cuda.empty_cache()  # what an earlier case cached
    free, _ = torch.cuda.mem_get_info()
    if free < 50 * 2 ** 30:
        pytest.skip("needs 50 GiB of free GPU memory")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, s, h, d, device="cuda", dtype=BF16, generator=gen)
    k, v = (torch.randn(b, s, kv_heads, d, device="cuda", dtype=BF16, generator=gen) for _ in range(2))
    dout = torch.randn_like(q)
    kwargs = _past_2_31_masks(b, s)[mask]
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out = flash_attn(q, k, v, **kwargs)
    out.backward(dout)
    assert q.numel() > 2 ** 31 and out.numel() > 2 ** 31 and q.grad.numel() > 2 ** 31
    for i in (0, 63, 64, 79):  # batch 64 starts at element 2**31 exactly
        one = [t[i:i + 1].detach().clone().requires_grad_() for t in (q, k, v)]
        part = {name: (x[i:i + 1] if name == "segment_ids" else x) for name, x in kwargs.items()}
        out_i = flash_attn(*one, **part)
        out_i.backward(dout[i:i + 1])
        for name, big, small in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad),
                                    (out_i, *(t.grad for t in one))):
            if name == "dq":  # the Gluon backward (causal, Hopper) adds dQ tiles in arrival order
                assert rel_err(big[i:i + 1], small) <= 1e-4, f"{name} of batch {i}"
            else:
                assert torch.equal(big[i:i + 1], small), f"{name} of batch {i}"
        if mask == "causal":
            ref = [t[i:i + 1].detach().transpose(1, 2).float().requires_grad_() for t in (q, k, v)]
            ref_out = torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=True,
                                                                       enable_gqa=kv_heads != h)
            ref_out.backward(dout[i:i + 1].transpose(1, 2).float())
            for name, got, want in zip(("out", "dq", "dk", "dv"), (out_i, *(t.grad for t in one)),
                                       (ref_out, *(t.grad for t in ref))):
                assert rel_err(got, want.transpose(1, 2)) < 2e-2, f"{name} of batch {i} against SDPA"
