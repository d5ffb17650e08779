"""The Gluon Hopper backward (kernels/gluon/bwd.py) on an sm_90 GPU against the float64 oracle.

Skipped without CUDA or on a GPU other than sm_90. Each case runs in a subprocess with a
timeout: a warp-specialized kernel that waits on an mbarrier nobody completes (a
missing expect or arrive, a wrong phase) hangs the GPU instead of failing, and the
timeout turns that into a failed test rather than a stuck suite.

Inputs: q, dout bf16 (B, Sq, H, 128), k, v (B, Sk, Hkv, 128): milestone 1's non-causal
MHA, the causal band with offsets (key j seen by query i iff j <= i + o: 0 the diagonal,
+128 / -128 the ring's neighbouring blocks, -100 a diagonal through the middle of Q tiles,
Sq != Sk, every K tile empty, every pair visible), GQA / MQA, the deterministic order of
dQ's adds (each such case run twice for the same bits), a window's lower edge
(``band_lo``: key j seen only if j >= i + band_lo), head_dim 64, segment ids (packed
documents, padding), block masks and dropout (the library's bits on the pair's global
positions; the oracle drops the same pairs). lse and delta are the
oracle's (float64 out and lse rounded to fp32; lse -inf for a row that sees no key), so
the kernel is checked alone. The yardsticks are tests/test_kernels_gpu.py's: relative
Frobenius error against the float64 oracle within TOL[bf16] (2e-2), and no more than twice
the error of the library's own Triton backward on the same inputs (or NOISE_FLOOR). dq_acc
starts from random values and must come back as those plus scale * dQ (the kernel adds),
untouched exactly on the rows that see no key; dk and dv start as NaN (a K tile no query
sees must write zeros), or in the "add" cases as random fp32 sums that must come back as
those plus the gradients (``accumulate=True``: the ring's running dK/dV).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

TESTS = Path(__file__).resolve().parent
TIMEOUT_S = 300  # compile (~10 s a variant, cached afterwards), the float64 oracle at 4k, one launch

# (batch, Sq, Sk, heads, kv heads, causal offset or None, layout, softmax scale or None for
# head_dim ** -0.5), smallest first within each group
CASES = [
    # milestone 1: non-causal MHA
    (1, 128, 128, 4, 4, None, "contiguous", None), (2, 128, 128, 4, 4, None, "contiguous", None),
    (1, 1024, 1024, 4, 4, None, "contiguous", None), (2, 1024, 1024, 4, 4, None, "contiguous", None),
    (1, 4096, 4096, 4, 4, None, "contiguous", None), (2, 4096, 4096, 4, 4, None, "contiguous", None),
    (2, 1024, 1024, 4, 4, None, "strided", 0.07),
    # the causal band
    (1, 128, 128, 4, 4, 0, "contiguous", None), (1, 1024, 1024, 4, 4, 0, "contiguous", None),
    (1, 1024, 1024, 4, 4, 128, "contiguous", None), (1, 1024, 1024, 4, 4, -128, "contiguous", None),
    (2, 1024, 1024, 4, 4, -100, "contiguous", None), (1, 256, 512, 4, 4, 256, "contiguous", None),
    (1, 512, 256, 4, 4, -256, "contiguous", None), (1, 512, 512, 4, 4, -512, "contiguous", None),
    (1, 512, 512, 4, 4, 4096, "contiguous", None), (2, 4096, 4096, 4, 4, 0, "contiguous", None),
    (2, 1024, 1024, 4, 4, 0, "strided", 0.07),
    # GQA and MQA
    (2, 1024, 1024, 8, 2, None, "contiguous", None), (2, 1024, 1024, 8, 2, 0, "contiguous", None),
    (1, 1024, 1024, 8, 2, -128, "contiguous", None), (1, 512, 512, 4, 1, 0, "contiguous", None),
    # accumulate: dK/dV added into fp32 running sums (the ring's steps)
    (1, 1024, 1024, 4, 4, None, "add", None), (2, 1024, 1024, 8, 2, 0, "add", None),
    (1, 512, 1024, 4, 4, -256, "add", None),
    # deterministic: dQ adds in a fixed order of K tiles (bits repeat); more K tiles than a
    # dispatch round (16) and more CTAs than SMs in the larger ones
    (1, 1024, 1024, 4, 4, None, "det", None), (2, 4096, 4096, 4, 4, None, "det", None),
    (1, 1024, 1024, 4, 4, 0, "det", None), (2, 4096, 4096, 4, 4, 0, "det", None),
    (1, 8192, 8192, 4, 4, 0, "det", None), (2, 1024, 1024, 4, 4, -100, "det", None),
    (1, 256, 512, 4, 4, 256, "det", None), (1, 512, 256, 4, 4, -256, "det", None),
    (1, 512, 512, 4, 4, -512, "det", None), (2, 1024, 1024, 8, 2, 0, "det", None),
    (1, 512, 512, 4, 1, 0, "det", None), (1, 2048, 2048, 8, 2, None, "det", None),
    # a window's lower edge, band_lo (the 9th field): key j seen only if j >= i + band_lo;
    # with the causal edge, wide (an unmasked middle) and narrower than a K tile (a Q tile
    # across both edges), off-diagonal as the ring's pairs are, alone, GQA, the ring's add
    (1, 1024, 1024, 4, 4, 0, "contiguous", None, -512), (2, 1024, 1024, 4, 4, 0, "contiguous", None, -100),
    (1, 1024, 1024, 4, 4, 0, "contiguous", None, -1), (1, 1024, 1024, 4, 4, 512, "contiguous", None, 300),
    (1, 512, 1024, 4, 4, None, "contiguous", None, -200), (2, 1024, 1024, 8, 2, 0, "contiguous", None, -300),
    (1, 1024, 1024, 4, 4, 0, "add", None, -256), (1, 4096, 4096, 4, 4, 0, "contiguous", None, -1000),
    # deterministic with a window: a Q tile's turns count from the lowest K tile reaching it
    (1, 1024, 1024, 4, 4, 0, "det", None, -300), (2, 4096, 4096, 8, 2, 0, "det", None, -1000),
    (1, 512, 1024, 4, 4, None, "det", None, -200),
    # head_dim 64 ("hd64": contiguous)
    (1, 1024, 1024, 4, 4, None, "hd64", None), (2, 1024, 1024, 4, 4, 0, "hd64", None),
    (2, 1024, 1024, 8, 2, 0, "hd64", None), (1, 512, 1024, 4, 4, -256, "hd64", None),
    (1, 4096, 4096, 4, 4, 0, "hd64", None),
    # segment ids (the 10th field, tests/test_gluon_fwd_gpu.py's ``_segment_ids`` pattern;
    # compiled on the CPU, not yet routed): packed documents with and without the causal
    # band, padding at the end and inside documents, the ring's shifted pair, GQA, the add,
    # a window, head_dim 64
    (2, 1024, 1024, 4, 4, 0, "contiguous", None, None, "docs"),
    (2, 1024, 1024, 4, 4, None, "contiguous", None, None, "docs"),
    (1, 2048, 2048, 4, 4, 0, "contiguous", None, None, "pad"),
    (1, 1024, 1024, 4, 4, 0, "contiguous", None, None, "holes"),
    (2, 1024, 1024, 4, 4, 1024, "contiguous", None, None, "shifted"),
    (2, 1024, 1024, 8, 2, 0, "add", None, None, "docs"),
    (1, 2048, 2048, 4, 4, 0, "contiguous", None, -300, "docs"),
    (1, 1024, 1024, 4, 4, 0, "hd64", None, None, "docs"),
    # a block mask (the 11th field, ``_block_mask``: one random mask for every head, or one a
    # query head; "empty" computes nothing): non-causal, the causal band across its blocks,
    # an offset pair, GQA with the add, MQA, a window, head_dim 64
    (1, 1024, 1024, 4, 4, None, "contiguous", None, None, None, "shared"),
    (2, 1024, 1024, 4, 4, 0, "contiguous", None, None, None, "heads"),
    (1, 512, 1024, 4, 4, -256, "contiguous", None, None, None, "shared"),
    (2, 1024, 1024, 8, 2, 0, "add", None, None, None, "heads"),
    (1, 2048, 2048, 4, 1, 0, "contiguous", None, None, None, "heads"),
    (1, 1024, 1024, 4, 4, 0, "contiguous", None, -300, None, "heads"),
    (1, 1024, 1024, 4, 4, 0, "hd64", None, None, None, "heads"),
    (1, 1024, 1024, 4, 4, None, "contiguous", None, None, None, "empty"),
    # dropout (the 12th field: [p, seed, PairMask.pos, dropout_head0]): the library's bits
    # (kernels/dropout.py) on global positions, against the oracle with the same keep mask:
    # non-causal, the causal band with positions shifted as a ring's pair, block_stripe's
    # jump with a window, GQA with the add and a global head offset, packed documents, a
    # high rate, head_dim 64
    (1, 1024, 1024, 4, 4, None, "contiguous", None, None, None, None, [0.1, 1234, [0, 0, 1, 0], 0]),
    (2, 1024, 1024, 4, 4, 0, "contiguous", None, None, None, None, [0.2, 7, [4096, 2048, 1, 0], 0]),
    (1, 1024, 1024, 4, 4, 0, "contiguous", None, -300, None, None, [0.1, 2 ** 40 + 3, [256, 256, 1, 384], 0]),
    (2, 1024, 1024, 8, 2, 0, "add", None, None, None, None, [0.1, 99, [1024, 0, 1, 0], 8]),
    (2, 1024, 1024, 4, 4, 0, "contiguous", None, None, "docs", None, [0.1, 5, [0, 0, 1, 0], 0]),
    (1, 2048, 2048, 4, 4, None, "contiguous", None, None, None, None, [0.6, 11, [0, 0, 1, 0], 0]),
    (1, 1024, 1024, 4, 4, 0, "hd64", None, None, None, None, [0.1, 3, [0, 0, 1, 0], 0]),
]


def dropout_case(dropout, b: int, h: int, sq: int, sk: int) -> tuple[dict, tuple | None]:
    """A case's dropout field [p, seed, PairMask.pos, dropout_head0] (or None) as (the
    kernels' keywords, the oracle's ``dropped``: the library's keep mask on the pair's
    global positions and heads, and the kept scale)."""
    if dropout is None:
        return {}, None
    from ringflash.kernels import dropout as bits
    from ringflash.kernels.masks import pair_positions
    p, seed, pos, head0 = dropout
    qp, kp = pair_positions(tuple(pos), torch.arange(sq), torch.arange(sk))
    keep = bits.dropout_keep_mask(seed, p, b, head0 + h, sq, sk, q_positions=qp, k_positions=kp)[:, head0:]
    return dict(dropout_p=p, seed=seed, pos=tuple(pos), dropout_head0=head0), (keep.cuda(), bits.keep_scale(p))


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def mask_id(offset, band_lo=None, segments=None, blocks=None, dropout=None) -> str:
    """A case's mask in its test id: the causal offset, the band's lower edge, the ids, the
    block mask, dropout's rate and positions."""
    mask = "full" if offset is None else f"causal{offset:+d}"
    mask += "" if band_lo is None else f"-lo{band_lo:+d}"
    mask += "" if blocks is None else f"-blocks_{blocks}"
    mask += "" if dropout is None else f"-drop{dropout[0]}_at{'_'.join(map(str, dropout[2]))}_h{dropout[3]}"
    return mask + ("" if segments is None else f"-{segments}")


def _block_mask(kind: str, h: int, sq: int, sk: int) -> torch.Tensor:
    """(1 or h, Sq / 128, Sk / 128) bool: random blocks at density 1/2 for every head
    ("shared") or per query head ("heads"), none at all ("empty"), or local + global
    attention for every head ("global": the diagonal block, and block row and column 1
    whole: one row of blocks with many times the others' work, which the forward's launch
    runs first, ``masks.program_order``)."""
    gen = torch.Generator().manual_seed(1)
    shape = (1 if kind in ("shared", "global") else h, sq // 128, sk // 128)
    if kind == "global":
        grid = torch.eye(shape[1], shape[2], dtype=torch.bool)[None]
        grid[:, 1, :] = grid[:, :, 1] = True
        return grid
    return torch.zeros(shape, dtype=torch.bool) if kind == "empty" else torch.rand(shape, generator=gen) < 0.5


def _id(b, sq, sk, h, hkv, offset, layout, scale, band_lo=None, segments=None, blocks=None, dropout=None) -> str:
    mask = mask_id(offset, band_lo, segments, blocks, dropout)
    return f"b{b}-q{sq}-k{sk}-h{h}kv{hkv}-{mask}-{layout}" + (f"-scale{scale}" if scale else "")


@pytest.mark.parametrize("case", CASES, ids=[_id(*c) for c in CASES])
def test_gluon_bwd_matches_oracle(case):
    if not _hopper():
        pytest.skip("needs an sm_90 (Hopper) GPU")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(Path(__file__).resolve()), json.dumps(list(case))]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=TESTS)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"attn_bwd_sm90 did not finish in {TIMEOUT_S} s (a hang: an mbarrier waited on but never "
                    f"completed?)\n{out[-2000:]}")
    assert done.returncode == 0, f"child failed (rc {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    res = json.loads(line[len("RESULT "):])
    from oracle import NOISE_FLOOR, TOL
    report = ", ".join(f"{name} {res['gluon'][name]:.2e} (library {res['library'][name]:.2e})"
                       for name in ("dq", "dk", "dv"))
    for name in ("dq", "dk", "dv"):
        err, lib = res["gluon"][name], res["library"][name]
        assert err <= TOL[torch.bfloat16], f"{name}: {report}"
        assert err <= max(2 * lib, NOISE_FLOOR), f"{name}: more than twice the library's error: {report}"
    # A query row that sees no key gets no dQ add; every other row gets one, which is exactly
    # zero only where the row sees one key (P = 1, so dS = dP - delta = 0) in every head.
    assert res["rows_seeing_nothing"] <= res["dq_untouched_rows"] <= res["rows_seeing_one"], res
    assert res["nan"] == 0, res
    if case[6] == "det":  # a second run from the same dq_acc, and one K tile at a time in order: the same bits
        assert res["repeats"], res


# ----------------------------------------------------------------------------- the child


def _inputs(b, sq, sk, h, hkv, layout, gen):
    """q, dout (B, Sq, H, D), k, v (B, Sk, Hkv, D) (bf16, CUDA) and empty dk, dv:
    contiguous, or (MHA, Sq = Sk) strided as a layer makes them (q, k, v views of one
    packed (B, S, 3, H, D) projection; dout heads-major; dk, dv views of one packed
    (B, S, 2, H, D) buffer); "add": contiguous, dk and dv random fp32 sums to add into;
    "det": contiguous, run with ``deterministic``; "hd64": contiguous at head_dim 64."""
    d = 64 if layout == "hd64" else 128

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    if layout in ("contiguous", "add", "det", "hd64"):
        q, dout = randn(b, sq, h, d), randn(b, sq, h, d)
        k, v = randn(b, sk, hkv, d), randn(b, sk, hkv, d)
        if layout == "add":
            return q, k, v, dout, *(torch.randn(k.shape, generator=gen, device="cuda") for _ in range(2))
        dk, dv = torch.empty_like(k), torch.empty_like(v)
    else:
        assert sq == sk and h == hkv, "the strided layout is one packed MHA projection"
        s = sq
        q, k, v = randn(b, s, 3, h, d).unbind(2)
        dout = randn(b, h, s, d).transpose(1, 2)
        dk, dv = torch.empty(b, s, 2, h, d, dtype=torch.bfloat16, device="cuda").unbind(2)
    return q, k, v, dout, dk.fill_(float("nan")), dv.fill_(float("nan"))


def _child(b, sq, sk, h, hkv, offset, layout, scale, band_lo=None, segments=None, block_kind=None,
           dropout=None) -> dict:
    sys.path.insert(0, str(TESTS))
    from oracle import attention_oracle, oracle_grads, rel_err
    from test_gluon_fwd_gpu import _segment_ids

    from ringflash.kernels import PairMask
    from ringflash.kernels import triton as triton_kernels
    from ringflash.kernels.masks import Blocks
    from ringflash.kernels.gluon import attn_bwd_sm90

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout, dk, dv = _inputs(b, sq, sk, h, hkv, layout, gen)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    i, j = torch.arange(sq, device="cuda")[:, None], torch.arange(sk, device="cuda")[None, :]
    visible = torch.ones(sq, sk, dtype=torch.bool, device="cuda")
    if offset is not None:
        visible &= j <= i + offset
    if band_lo is not None:
        visible &= j >= i + band_lo
    q_ids = k_ids = None
    if segments is not None:  # (b, sq, sk): the band and the same document (padding sees nothing)
        q_ids, k_ids = _segment_ids(segments, b, sq, sk)
        visible = visible[None] & (q_ids[:, :, None] == k_ids[:, None, :]) & (q_ids[:, :, None] >= 0)
    blocks = None
    if block_kind is not None:  # (1, 1 or h, sq, sk): the band inside the listed blocks
        grid = _block_mask(block_kind, h, sq, sk).cuda()
        blocks = Blocks(grid)
        visible = visible[None, None] & grid.repeat_interleave(128, 1).repeat_interleave(128, 2)[None]
    drop, dropped = dropout_case(dropout, b, h, sq, sk)
    out, lse = attention_oracle(q, k, v, softmax_scale=scale, mask=visible, dropped=dropped)
    delta = (out * dout.double()).sum(-1).transpose(1, 2).float().contiguous()  # (B, H, S)
    lse = lse.float().contiguous()
    ref = oracle_grads(q, k, v, dout, softmax_scale=scale, mask=visible, dropped=dropped)

    dq0 = torch.randn(q.shape, generator=gen, device="cuda")
    dq_acc = dq0.clone()
    add, det = layout == "add", layout == "det"
    dk0, dv0 = dk.clone(), dv.clone()
    attn_bwd_sm90(dout, q, k, v, lse, delta, dq_acc, dk, dv, scale, causal_offset=offset, accumulate=add,
                  deterministic=det, band_lo=band_lo, q_segments=q_ids, k_segments=k_ids, blocks=blocks, **drop)
    torch.cuda.synchronize()
    repeats = None
    if det:  # the same bits again, and those of one K tile at a time, in increasing order
        again = dq0.clone()
        attn_bwd_sm90(dout, q, k, v, lse, delta, again, torch.empty_like(dk), torch.empty_like(dv), scale,
                      causal_offset=offset, deterministic=True, band_lo=band_lo)
        in_order = dq0.clone()
        for j in range(0, sk, 128):
            tile = [t[:, j:j + 128] for t in (k, v)]
            attn_bwd_sm90(dout, q, *tile, lse, delta, in_order, torch.empty_like(tile[0]), torch.empty_like(tile[1]),
                          scale, causal_offset=None if offset is None else offset - j,
                          band_lo=None if band_lo is None else band_lo - j)
        repeats = bool(torch.equal(again, dq_acc)) and bool(torch.equal(in_order, dq_acc))
    dq = dq_acc.double() - dq0.double()
    if add:
        dk, dv = dk.double() - dk0.double(), dv.double() - dv0.double()

    lib = [torch.full(t.shape, float("nan"), device="cuda") for t in (q, k, v)]
    triton_kernels.bwd(dout, q, k, v, lse, delta, *lib, softmax_scale=scale,
                       mask=PairMask(band_lo=band_lo, band_hi=offset, q_segments=q_ids, k_segments=k_ids,
                                     blocks=blocks, **drop), accumulate=False)
    torch.cuda.synchronize()
    names = ("dq", "dk", "dv")
    seen = visible.sum(dim=-1)  # keys a row sees: (Sq,), (B, Sq) or, with a block mask, (1, 1 or H, Sq)
    seen = seen.amax(1) if seen.dim() == 3 else seen  # the most any head's row sees
    return dict(gluon={n: rel_err(g, r) for n, g, r in zip(names, (dq, dk, dv), ref)},
                library={n: rel_err(g, r) for n, g, r in zip(names, lib, ref)},
                dq_untouched_rows=int((dq.abs().amax(dim=(-1, -2)) == 0).sum()), repeats=repeats,
                rows_seeing_nothing=int((seen == 0).expand(b, sq).sum()),
                rows_seeing_one=int((seen <= 1).expand(b, sq).sum()),
                nan=int(sum(torch.isnan(t).sum() for t in (dq_acc, dk, dv))))


if __name__ == "__main__":
    result = _child(*json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
