"""The heads x ring grid's chunked path (ringflash.heads: chunks of heads whose all-to-alls
overlap the ring) on CUDA over NCCL. Run on 2 or 4 GPUs, every process running pytest:

    NCCL_NVLS_ENABLE=0 timeout 600 torchrun --nproc-per-node=4 \\
        -m pytest tests/test_heads_gpu.py -x -q -p no:cacheprovider

Skipped without CUDA or outside torchrun. Every rank runs the same tests in the same
order and agrees on the verdict with an all-reduce (as tests/test_ring_gpu.py does).

- small, fp32 (TF32 off): tests/test_heads.py's chunk cases (MHA, GQA, MQA, uneven GQA
  with kv_heads < U, segment ids, per-head block masks, dropout) at every (U, R) the world
  allows (U = 1: the ring alone, its heads in turn), chunked (RINGFLASH_HEAD_CHUNKS=4)
  against the float64 oracle, and against the unchunked call (=1);
- large, bf16 (32 heads, GQA 8, head_dim 128, 4096 tokens a rank, causal zigzag): the
  chunked call against the unchunked one, and both finite;
- the ring alone in 1, 2 and 4 chunks one after another, bf16, deterministic backward, on
  either transport (the copy engines send a chunk's K/V from the views of its heads): the
  same bits, MHA and GQA, a window on block_stripe (the Triton kernels) and causal zigzag.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import ringflash
from oracle import rel_err

pytestmark = pytest.mark.gpu

TOL_F32 = 1e-4  # against the float64 oracle; the GPU's exp2 is an approximation
APART_F32 = 1e-5  # chunked against unchunked: the same kernels per head, at most the sums' order
APART_BF16 = 5e-3


# The NCCL world of the torchrun launch and the verdict every rank agrees on, as the ring's
# GPU tests have them.
from test_ring_gpu import _agree, nccl  # noqa: E402,F401 (nccl: a fixture)


def _heads_worlds(world: int) -> list[int]:
    """U of the grids the world allows; 1: the ring alone, its heads one chunk after another
    (``heads.memory_chunks``)."""
    return [u for u in (1, 2, 4) if u <= world and world % u == 0]


@pytest.mark.parametrize("u", [1, 2, 4], ids=lambda u: f"U{u}")
def test_chunked_grid_matches_oracle(nccl, u):
    from test_heads import CHUNK_CASES, CHUNKS_RUN, check_chunks
    world, rank = dist.get_world_size(), dist.get_rank()
    if u not in _heads_worlds(world):  # the same on every rank: no collective left waiting
        pytest.skip(f"U = {u} needs a world of a multiple of {u} ranks, this one has {world}")
    failures = []
    layout = "contiguous" if u == world else "block_stripe"
    seqlen = 128 * world if u == 1 else 256  # as tests/test_heads.py
    report = check_chunks(rank, world, u, layout, CHUNK_CASES, seqlen, device=nccl, tol=TOL_F32)
    for name, (used, _differ, apart, errors) in report.items():
        where = f"{u}x{world // u} {name}"
        if used != CHUNKS_RUN[u][name]:
            failures.append(f"{where}: ran in {used} chunks, not {CHUNKS_RUN[u][name]}")
        if not apart <= APART_F32:
            failures.append(f"{where}: chunked and unchunked differ by {apart:.3g}")
        failures += errors
    _agree(failures)


def _large(heads_world, device, chunks: str) -> dict:
    """out, lse and the gradients of a bf16 grid call with RINGFLASH_HEAD_CHUNKS=chunks."""
    from test_heads import _grid
    world, rank = dist.get_world_size(), dist.get_rank()
    group = _grid(rank, world, heads_world, "pair", "cuda")
    gen = torch.Generator(device=device).manual_seed(rank)
    n = 4096
    q, dout = (torch.randn(1, n, 32, 128, device=device, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, n, 8, 128, device=device, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    os.environ["RINGFLASH_HEAD_CHUNKS"] = chunks
    try:
        out, lse = ringflash.ring_flash_attn(q, k, v, causal=True, group=group, return_lse=True)
        out.backward(dout)
    finally:
        del os.environ["RINGFLASH_HEAD_CHUNKS"]
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def test_chunked_grid_bf16_matches_unchunked(nccl):
    failures = []
    for heads_world in _heads_worlds(dist.get_world_size()):
        whole, chunked = _large(heads_world, nccl, "1"), _large(heads_world, nccl, "4")
        for name, t in chunked.items():
            if not torch.isfinite(t).all():
                failures.append(f"U={heads_world} {name}: not finite")
            apart = rel_err(t.float(), whole[name].float())
            if not apart <= APART_BF16:
                failures.append(f"U={heads_world} {name}: chunked and unchunked differ by {apart:.3g}")
    _agree(failures)


def _in_turn(transport: str, heads_kv: tuple, case: dict, chunks: str, monkeypatch) -> list:
    """out, lse and the gradients of a deterministic bf16 ring-alone call in ``chunks``
    chunks, one after another."""
    rank = dist.get_rank()
    gen = torch.Generator(device="cuda").manual_seed(rank)
    n, (h, hkv) = 1024, heads_kv
    q, dout = (torch.randn(1, n, h, 128, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, n, hkv, 128, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    monkeypatch.setenv("RINGFLASH_TRANSPORT", transport)
    monkeypatch.setenv("RINGFLASH_HEAD_CHUNKS", chunks)
    out, lse = ringflash.ring_flash_attn(q, k, v, deterministic=True, return_lse=True, **case)
    out.backward(dout)
    torch.cuda.synchronize()
    return [out, lse, q.grad, k.grad, v.grad]


@pytest.mark.parametrize("transport", ["nccl", "peer"])
def test_chunks_in_turn_give_the_same_bits(nccl, transport, monkeypatch):
    failures = []
    cases = {"window block_stripe": dict(causal=True, window_size=(300, 0), layout="block_stripe"),
             "causal zigzag": dict(causal=True, layout="zigzag")}
    for heads_kv in ((8, 8), (8, 2)):
        for name, case in cases.items():
            whole = _in_turn(transport, heads_kv, case, "1", monkeypatch)
            for chunks in ("2", "4"):
                got = _in_turn(transport, heads_kv, case, chunks, monkeypatch)
                for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, whole):
                    if not torch.equal(a, b):
                        failures.append(f"{transport} {heads_kv} {name}, {chunks} chunks: {what} differs "
                                        f"(max {(a.float() - b.float()).abs().max().item():.3g})")
    _agree(failures)
