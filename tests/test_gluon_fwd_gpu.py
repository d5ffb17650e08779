"""The Gluon Hopper forward (kernels/gluon/fwd.py) on an sm_90 GPU against the float64 oracle.

Skipped without CUDA or on a GPU other than sm_90; each case in a subprocess with a
timeout, as tests/test_gluon_gpu.py runs the backward (a wrong mbarrier phase hangs
instead of failing). Inputs: q (B, Sq, H, 128), k, v (B, Sk, Hkv, 128) (and head_dim 64),
bf16; no mask or
the causal band with offsets (key j seen by query i iff j <= i + o: the diagonal, the
ring's neighbouring blocks at +-128, a diagonal through the middle of Q tiles at -100
and +37, Sq != Sk, every key hidden, every pair visible), a window's lower edge, GQA and
MQA, strided views of one packed projection, segment ids (packed documents, padding), block
masks, dropout (the library's bits on the pair's global positions). Modes:

- "write": out (bf16) and lse (a view into a longer buffer, as the ring's) NaN-prefilled, written;
- "add": ``accumulate`` into an fp32 running out and lse holding the oracle's result over
  another 256 keys (every third row of it empty: out 0, lse -inf), which must come back as
  the oracle over both key sets (with dropout: the running result merged with the oracle's
  dropped one over this call's keys, by the rule the ring merges with);
- "partial": the same sums read from ``out_partial`` (fp32) and the result written into a
  NaN-prefilled bf16 out (the ring's last step).

The yardsticks are tests/test_kernels_gpu.py's: out's relative Frobenius error within
TOL[bf16] and at most twice the library's Triton forward's on the same call (or
NOISE_FLOOR); lse within 1e-5 of the oracle's (it is fp32 arithmetic on fp32 sums); a
row that sees no key at all: out exactly 0 and lse -inf; no NaN anywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_gluon_gpu import _hopper, dropout_case, mask_id

pytestmark = pytest.mark.gpu

TESTS = Path(__file__).resolve().parent
TIMEOUT_S = 300

# (batch, Sq, Sk, heads, kv heads, causal offset or None, mode, layout[, band_lo])
CASES = [
    (1, 128, 128, 4, 4, None, "write", "contiguous"), (2, 1024, 1024, 4, 4, None, "write", "contiguous"),
    (1, 4096, 4096, 4, 4, None, "write", "contiguous"), (2, 1024, 1024, 4, 4, None, "write", "strided"),
    (1, 128, 128, 4, 4, 0, "write", "contiguous"), (2, 1024, 1024, 4, 4, 0, "write", "contiguous"),
    (1, 1024, 1024, 4, 4, 128, "write", "contiguous"), (1, 1024, 1024, 4, 4, -128, "write", "contiguous"),
    (2, 1024, 1024, 4, 4, -100, "write", "contiguous"), (1, 1024, 1024, 4, 4, 37, "write", "contiguous"),
    (1, 256, 512, 4, 4, 256, "write", "contiguous"), (1, 512, 256, 4, 4, -256, "write", "contiguous"),
    (1, 512, 512, 4, 4, -512, "write", "contiguous"), (1, 512, 512, 4, 4, 4096, "write", "contiguous"),
    (2, 4096, 4096, 4, 4, 0, "write", "contiguous"), (2, 1024, 1024, 4, 4, 0, "write", "strided"),
    (2, 1024, 1024, 8, 2, None, "write", "contiguous"), (2, 1024, 1024, 8, 2, 0, "write", "contiguous"),
    (1, 512, 512, 4, 1, -128, "write", "contiguous"),
    (1, 1024, 1024, 4, 4, None, "add", "contiguous"), (2, 1024, 1024, 8, 2, 0, "add", "contiguous"),
    (1, 512, 1024, 4, 4, -256, "add", "contiguous"), (1, 1024, 1024, 4, 4, -100, "partial", "contiguous"),
    (2, 1024, 1024, 4, 4, 0, "partial", "strided"),
    # head_dim 64 (layout "hd64": contiguous; compiled on the CPU, not yet routed)
    (2, 1024, 1024, 4, 4, None, "write", "hd64"), (1, 1024, 1024, 8, 2, 0, "write", "hd64"),
    (1, 512, 1024, 4, 4, -256, "add", "hd64"),
    # a window's lower edge (the 9th field, band_lo: key j seen only if j >= i + band_lo;
    # compiled on the CPU, not yet routed): with the causal edge wide, narrower than a K
    # tile and one key wide, off the diagonal as the ring's pairs are, alone, GQA, the
    # ring's merge and last step, head_dim 64
    (1, 1024, 1024, 4, 4, 0, "write", "contiguous", -300), (2, 1024, 1024, 4, 4, 0, "write", "contiguous", -100),
    (1, 1024, 1024, 4, 4, 0, "write", "contiguous", 0), (1, 1024, 1024, 4, 4, 512, "write", "contiguous", 300),
    (1, 512, 1024, 4, 4, None, "write", "contiguous", -200), (2, 1024, 1024, 8, 2, 0, "add", "contiguous", -300),
    (1, 4096, 4096, 4, 4, 0, "partial", "contiguous", -1000), (1, 1024, 1024, 4, 4, 0, "write", "hd64", -256),
    # segment ids (the 10th field, ``_segment_ids``' pattern; compiled on the CPU, not yet
    # routed): packed documents with and without the causal band, padding at the end and
    # inside documents, the ring's pair of a shard and the one before it, GQA, a window,
    # the merge and the last step, head_dim 64
    (2, 1024, 1024, 4, 4, 0, "write", "contiguous", None, "docs"),
    (2, 1024, 1024, 4, 4, None, "write", "contiguous", None, "docs"),
    (1, 2048, 2048, 4, 4, 0, "write", "contiguous", None, "pad"),
    (1, 1024, 1024, 4, 4, 0, "write", "contiguous", None, "holes"),
    (2, 1024, 1024, 4, 4, 1024, "write", "contiguous", None, "shifted"),
    (2, 1024, 1024, 8, 2, 0, "add", "contiguous", None, "docs"),
    (1, 2048, 2048, 4, 4, 0, "write", "contiguous", -300, "docs"),
    (1, 1024, 1024, 4, 4, 1024, "partial", "contiguous", None, "shifted"),
    (1, 1024, 1024, 4, 4, 0, "write", "hd64", None, "docs"),
    # a block mask (the 11th field, tests/test_gluon_gpu.py's ``_block_mask``: one for every
    # head, one a query head, or none at all): without a band, causal, an offset pair, GQA
    # with the merge, MQA, a window, the last step
    (1, 1024, 1024, 4, 4, None, "write", "contiguous", None, None, "shared"),
    (2, 1024, 1024, 4, 4, 0, "write", "contiguous", None, None, "heads"),
    (1, 512, 1024, 4, 4, -256, "write", "contiguous", None, None, "shared"),
    (2, 1024, 1024, 8, 2, 0, "add", "contiguous", None, None, "heads"),
    (1, 2048, 2048, 4, 1, 0, "write", "contiguous", None, None, "heads"),
    (1, 1024, 1024, 4, 4, 0, "write", "contiguous", -300, None, "heads"),
    (1, 1024, 1024, 4, 4, -100, "partial", "contiguous", None, None, "shared"),
    (1, 1024, 1024, 4, 4, None, "write", "contiguous", None, None, "empty"),
    # a global row of blocks, which the launch runs first (``masks.program_order``), without
    # and with the band (whose order is reversed), GQA with the merge, batch 2
    (1, 2048, 2048, 4, 4, None, "write", "contiguous", None, None, "global"),
    (2, 2048, 2048, 8, 2, 0, "add", "contiguous", None, None, "global"),
    # dropout (the 12th field: [p, seed, PairMask.pos, dropout_head0], as tests/test_gluon_gpu.py's):
    # non-causal, the causal band with positions shifted as a ring's pair, block_stripe's
    # jump with a window, GQA with the merge and a global head offset, packed documents, a
    # high rate, the last step, head_dim 64
    (1, 1024, 1024, 4, 4, None, "write", "contiguous", None, None, None, [0.1, 1234, [0, 0, 1, 0], 0]),
    (2, 1024, 1024, 4, 4, 0, "write", "contiguous", None, None, None, [0.2, 7, [4096, 2048, 1, 0], 0]),
    (1, 1024, 1024, 4, 4, 0, "write", "contiguous", -300, None, None, [0.1, 2 ** 40 + 3, [256, 256, 1, 384], 0]),
    (2, 1024, 1024, 8, 2, 0, "add", "contiguous", None, None, None, [0.1, 99, [1024, 0, 1, 0], 8]),
    (2, 1024, 1024, 4, 4, 0, "write", "contiguous", None, "docs", None, [0.1, 5, [0, 0, 1, 0], 0]),
    (1, 2048, 2048, 4, 4, None, "write", "contiguous", None, None, None, [0.6, 11, [0, 0, 1, 0], 0]),
    (1, 1024, 1024, 4, 4, -100, "partial", "contiguous", None, None, None, [0.1, 3, [16, 32, 1, 0], 0]),
    (1, 1024, 1024, 4, 4, 0, "write", "hd64", None, None, None, [0.1, 3, [0, 0, 1, 0], 0]),
]


def _id(b, sq, sk, h, hkv, offset, mode, layout, band_lo=None, segments=None, blocks=None, dropout=None) -> str:
    return f"b{b}-q{sq}-k{sk}-h{h}kv{hkv}-{mask_id(offset, band_lo, segments, blocks, dropout)}-{mode}-{layout}"


def _segment_ids(pattern: str, b: int, sq: int, sk: int):
    """(q ids (b, sq), k ids (b, sk)) int32 on the GPU. Documents of 1 to 700 tokens, some
    ending on a tile's edge (a different draw per batch row); "pad": the last 300 tokens
    padding (-1); "holes": a few padding tokens inside documents; "shifted": the ring's pair
    of a shard (queries, the last sq tokens) and the one before it (keys, the first sk) of
    one packed sequence; else queries and keys the same tokens."""
    gen = torch.Generator().manual_seed(1)
    total = sq + sk if pattern == "shifted" else sk
    rows = []
    for _ in range(b):
        lengths = []
        while sum(lengths) < total:
            lengths.append(int(torch.randint(1, 700, (1,), generator=gen)) if len(lengths) % 4 else 128 * 2)
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:total]
        if pattern == "pad":
            ids[-300:] = -1
        if pattern == "holes":
            ids[torch.randint(0, total, (12,), generator=gen)] = -1
        rows.append(ids)
    ids = torch.stack(rows).to(torch.int32).cuda()
    if pattern == "shifted":
        return ids[:, sk:].contiguous(), ids[:, :sk].contiguous()
    return ids, ids


@pytest.mark.parametrize("case", CASES, ids=[_id(*c) for c in CASES])
def test_gluon_fwd_matches_oracle(case):
    if not _hopper():
        pytest.skip("needs an sm_90 (Hopper) GPU")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(Path(__file__).resolve()), json.dumps(list(case))]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=TESTS)
    except subprocess.TimeoutExpired:
        pytest.fail(f"attn_fwd_sm90 did not finish in {TIMEOUT_S} s (a hang: an mbarrier never completed?)")
    assert done.returncode == 0, f"child failed (rc {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    res = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    from oracle import NOISE_FLOOR, TOL
    assert res["out"] <= TOL[torch.bfloat16], res
    assert res["out"] <= max(2 * res["library_out"], NOISE_FLOOR), res
    assert res["lse"] <= 1e-5 and res["nan"] == 0, res
    assert res["empty_rows_exact"], res


# ----------------------------------------------------------------------------- the child


def _child(b, sq, sk, h, hkv, offset, mode, layout, band_lo=None, segments=None, block_kind=None,
           dropout=None) -> dict:
    sys.path.insert(0, str(TESTS))
    from oracle import attention_oracle, rel_err
    from test_gluon_gpu import _block_mask

    from ringflash.kernels.masks import Blocks

    from ringflash.kernels import PairMask
    from ringflash.kernels import triton as triton_kernels
    from ringflash.kernels.gluon import attn_fwd_sm90

    gen = torch.Generator(device="cuda").manual_seed(0)
    D = 64 if layout == "hd64" else 128

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    if layout == "strided":  # views of one packed (B, S, 3, H, D) projection
        assert sq == sk and h == hkv
        q, k, v = randn(b, sq, 3, h, D).unbind(2)
    else:
        q, k, v = randn(b, sq, h, D), randn(b, sk, hkv, D), randn(b, sk, hkv, D)
    scale = D ** -0.5
    i, j = torch.arange(sq, device="cuda")[:, None], torch.arange(sk, device="cuda")[None, :]
    visible = torch.ones(sq, sk, dtype=torch.bool, device="cuda") if offset is None else j <= i + offset
    if band_lo is not None:
        visible = visible & (j >= i + band_lo)
    q_ids = k_ids = None
    if segments is not None:  # (b, sq, sk): the band and the same document (padding sees nothing)
        q_ids, k_ids = _segment_ids(segments, b, sq, sk)
        same = (q_ids[:, :, None] == k_ids[:, None, :]) & (q_ids[:, :, None] >= 0)
        visible = visible[None] & same
    blocks = None
    if block_kind is not None:  # (1, 1 or h, sq, sk): the band inside the listed blocks
        grid = _block_mask(block_kind, h, sq, sk).cuda()
        blocks = Blocks(grid)
        visible = visible[None, None] & grid.repeat_interleave(128, 1).repeat_interleave(128, 2)[None]
    drop, dropped = dropout_case(dropout, b, h, sq, sk)
    accumulate = mode != "write"
    if accumulate:  # a running result over 256 other keys, every third row empty
        k0, v0 = randn(b, 256, hkv, D), randn(b, 256, hkv, D)
        seen0 = (torch.arange(sq, device="cuda") % 3 != 0)[:, None].expand(sq, 256)
        out0, lse0 = attention_oracle(q, k0, v0, softmax_scale=scale, mask=seen0)
        if dropped is None:
            both = torch.cat([seen0.expand(visible.shape[:-1] + (256,)), visible], -1)
            want, want_lse = attention_oracle(q, torch.cat([k0, k], 1), torch.cat([v0, v], 1), softmax_scale=scale,
                                              mask=both)
        else:  # the running result merged with this call's dropped one: weights exp(lse - lse of both)
            out1, lse1 = attention_oracle(q, k, v, softmax_scale=scale, mask=visible, dropped=dropped)
            want_lse = torch.logaddexp(lse0, lse1)
            safe = torch.where(want_lse == float("-inf"), 0.0, want_lse)
            want = sum(torch.exp(lse_i - safe).transpose(1, 2)[..., None] * out_i
                       for lse_i, out_i in ((lse0, out0), (lse1, out1)))
        running = out0.float().contiguous()
        running_lse = lse0.float()
    else:
        want, want_lse = attention_oracle(q, k, v, softmax_scale=scale, mask=visible, dropped=dropped)
        seen0 = torch.zeros(sq, 1, dtype=torch.bool, device="cuda")

    def call(kernel):
        """(out, lse) of one call in ``mode`` through ``kernel`` (lse a view, as the ring's)."""
        lse = torch.full((b, h, sq + 128), float("nan"), device="cuda")[:, :, 64:64 + sq]
        if mode == "write":
            out = torch.full(q.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
            kernel(out, lse, False, None)
            return out, lse
        lse.copy_(running_lse)
        if mode == "add":
            out = running.clone()
            kernel(out, lse, True, None)
            return out, lse
        partial = running.clone()
        out = torch.full(q.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
        kernel(out, lse, True, partial)
        return out, lse

    out, lse = call(lambda o, s, acc, part: attn_fwd_sm90(q, k, v, o, s, scale, causal_offset=offset,
                                                           accumulate=acc, out_partial=part, band_lo=band_lo,
                                                           q_segments=q_ids, k_segments=k_ids, blocks=blocks,
                                                           **drop))
    lib_mask = PairMask(band_lo=band_lo, band_hi=offset, q_segments=q_ids, k_segments=k_ids, blocks=blocks, **drop)
    lib_out, _ = call(lambda o, s, acc, part: triton_kernels.fwd(q, k, v, o, s, softmax_scale=scale, mask=lib_mask,
                                                                 accumulate=acc, out_partial=part))
    torch.cuda.synchronize()
    empty = ~(visible.any(-1) | seen0.any(-1))  # rows seeing no key at all: (sq,), (b, sq) or (1, 1 or h, sq)
    empty = empty.expand(b, h, sq) if empty.dim() == 3 else empty.expand(b, sq)[:, None].expand(b, h, sq)
    empty_exact = (bool((out.transpose(1, 2)[empty] == 0).all())
                   and bool((lse[empty] == float("-inf")).all()))
    finite = ~empty
    return dict(out=rel_err(out.double(), want), library_out=rel_err(lib_out.double(), want),
                same_as_library=bool(torch.equal(out, lib_out)),  # reported, not asserted
                lse=rel_err(lse[finite].double(), want_lse[finite]),
                empty_rows=int(empty.sum()), empty_rows_exact=empty_exact,
                nan=int(torch.isnan(out).sum() + torch.isnan(lse).sum()))


if __name__ == "__main__":
    print("RESULT " + json.dumps(_child(*json.loads(sys.argv[1]))), flush=True)
