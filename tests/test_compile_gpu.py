"""The ring under torch.compile and CUDA graphs on GPUs (NCCL), every rank running pytest:

    NCCL_NVLS_ENABLE=0 timeout 900 torchrun --nproc-per-node=2 \\
        -m pytest tests/test_compile_gpu.py -x -q -p no:cacheprovider

- torch.compile(fullgraph=True) of an attention block (projections -> ring -> projection)
  with eager, aot_eager and inductor: one frame, forward and backward, equal to eager;
- a training step (forward, backward, SGD update) captured in one CUDA graph, with each
  transport (NCCL send/recv and the copy-engine ring), replayed on new inputs: the same
  gradients and parameters as the step run eagerly;
- both at head_dim 128 too (bf16, causal: on Hopper the ring's backward is the Gluon
  kernel at every step).

Skipped without CUDA or outside torchrun; verdicts agreed by an all-reduce (test_ring_gpu).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ringflash
from oracle import rel_err
from test_ring_gpu import _agree, nccl  # noqa: F401 - the NCCL world fixture

pytestmark = pytest.mark.gpu

D_MODEL, HEADS, KV_HEADS, HEAD_DIM = 256, 4, 2, 64


def _params(device, dtype, seed=0, head_dim=HEAD_DIM):
    gen = torch.Generator(device=device).manual_seed(seed)  # the same on every rank
    w_qkv = torch.randn(D_MODEL, (HEADS + 2 * KV_HEADS) * head_dim, generator=gen, device=device)
    w_out = torch.randn(HEADS * head_dim, D_MODEL, generator=gen, device=device)
    return [(w_qkv / D_MODEL ** 0.5).to(dtype), (w_out / D_MODEL ** 0.5).to(dtype)]


def _block(sp, head_dim=HEAD_DIM, **attn):
    def block(x, w_qkv, w_out):
        b, n, _ = x.shape
        qkv = (x @ w_qkv).view(b, n, HEADS + 2 * KV_HEADS, head_dim)
        q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=2)
        out = sp.attn(q, k, v.contiguous(), causal=True, **attn)
        y = out.reshape(b, n, HEADS * head_dim) @ w_out
        return y, y.float().square().mean()

    return block


def _x(device, dtype, seed, n_local=1024):
    gen = torch.Generator(device=device).manual_seed(100 + seed)
    x = torch.randn(2, n_local * dist.get_world_size(), D_MODEL, generator=gen, device=device)
    return x.to(dtype)


def _step(fn, sp, x, params):
    leaves = [sp.shard(x).requires_grad_(), *(p.detach().clone().requires_grad_() for p in params)]
    y, loss = fn(*leaves)
    loss.backward()
    return [y.detach(), loss.detach(), *(t.grad for t in leaves)]


COMPILE_CASES = [(backend, dtype, 64) for backend in ("eager", "aot_eager", "inductor")
                 for dtype in (torch.bfloat16, torch.float32)] + [("inductor", torch.bfloat16, 128)]


@pytest.mark.parametrize("backend,dtype,head_dim", COMPILE_CASES,
                         ids=[f"{b}-{'bf16' if d == torch.bfloat16 else 'fp32'}-d{h}" for b, d, h in COMPILE_CASES])
def test_fullgraph_compile_matches_eager(nccl, backend, dtype, head_dim):  # noqa: F811 - the fixture
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    sp = ringflash.SequenceParallel()
    params = _params(nccl, dtype, head_dim=head_dim)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(_block(sp, head_dim), fullgraph=True, backend=counter)
    failures = []
    for seed in range(2):
        x = _x(nccl, dtype, seed)
        want = _step(_block(sp, head_dim), sp, x, params)
        got = _step(compiled, sp, x, params)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        for name, a, b in zip(("y", "loss", "dx", "dw_qkv", "dw_out"), got, want):
            if not rel_err(a, b) <= tol:
                failures.append(f"{backend} {dtype} seed {seed}: {name} rel err {rel_err(a, b):.3g}")
    if counter.frame_count != 1:
        failures.append(f"{backend}: {counter.frame_count} frames (graph breaks or recompiles)")
    _agree(failures)


@pytest.mark.parametrize("transport,head_dim", [("nccl", 64), ("peer", 64), ("peer-block-sparse", 64),
                                                ("nccl", 128), ("peer", 128)])
def test_training_step_in_one_cuda_graph(nccl, transport, head_dim, monkeypatch):  # noqa: F811
    """Forward, backward and an SGD update of the block captured as one CUDA graph after
    eager warm-up on a side stream (NCCL communicators, Triton autotuning and the
    copy-engine buffers are all set up then), replayed on new inputs. peer-block-sparse:
    contiguous shards under a block mask, which on a ring of two is one forward launch
    waiting inside the kernel for the chunks of the other rank's K/V (stream memory
    operations in the graph; the flags must be down again at every replay)."""
    from ringflash.kernels.block_sparse import local_global_block_mask
    monkeypatch.setenv("RINGFLASH_TRANSPORT", transport.split("-")[0])
    sparse = transport.endswith("block-sparse")
    sp = ringflash.SequenceParallel(layout="contiguous" if sparse else "zigzag")
    dtype, lr = torch.bfloat16, 0.1
    attn = {}
    if sparse:
        attn["block_mask"] = local_global_block_mask(1024 * dist.get_world_size(), local_blocks=2,
                                                     global_blocks=1, device=nccl)
    block = _block(sp, head_dim, **attn)
    params = [p.requires_grad_() for p in _params(nccl, dtype, head_dim=head_dim)]
    x_static = sp.shard(_x(nccl, dtype, 0))

    def train_step():
        _, loss = block(x_static, *params)
        loss.backward()
        with torch.no_grad():
            for p in params:
                p.sub_(lr * p.grad)
                p.grad = None  # the next step's backward allocates it again (graph pool)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            train_step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    start = [p.detach().clone() for p in params]

    graph = torch.cuda.CUDAGraph()
    # thread_local: NCCL's watchdog thread may query events of the warm-up while we capture.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        train_step()

    failures = []
    for seed in (1, 2):
        x = sp.shard(_x(nccl, dtype, seed))
        # Eager reference of one step from the current parameters.
        ref = [p.detach().clone().requires_grad_() for p in params]
        _, loss = block(x, *ref)
        loss.backward()
        want = [p.detach() - lr * p.grad for p in ref]
        with torch.no_grad():
            x_static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        for i, (p, w) in enumerate(zip(params, want)):
            if not rel_err(p.detach(), w) <= 1e-2:
                failures.append(f"{transport} seed {seed}: parameter {i} after replay, rel err "
                                f"{rel_err(p.detach(), w):.3g}")
    if all(torch.equal(p, s) for p, s in zip(params, start)):
        failures.append(f"{transport}: replay changed no parameter")
    _agree(failures)
