"""The ring on CUDA over NCCL, against the float64 oracle and the single-GPU kernel.

Run on 4 and on 2 GPUs, several torchrun worlds at once (tests/run_gpu.py: the tests are
compile-bound from a cold Triton cache, and the worlds compile different kernels at once):

    python tests/run_gpu.py --nproc 4 tests/test_ring_gpu.py
    python tests/run_gpu.py --nproc 2 tests/test_ring_gpu.py

or as one world, every process running pytest (``torchrun --nproc-per-node=4 -m pytest
tests/test_ring_gpu.py -q``: over 9 minutes from a cold cache on 4 H200s).

Skipped without CUDA or outside torchrun. The session makes the NCCL world once
(conftest.nccl_world). Every rank runs the same tests in the same order, all collectives
of a test come before its assertions, and the verdict is agreed on by an all-reduce, so a
failure on one rank fails the test on every rank instead of leaving the others in a
collective.

Two checks:
- small (seqlen_local 512, 4 heads): ring vs the float64 oracle on the gathered full
  sequence, fp32 (IEEE, TF32 off) / fp16 / bf16, every layout, causal and not, GQA,
  gradient through lse;
- large (bf16, seqlen_local 4096, 32 heads, head_dim 128, batch 1; and GQA with 8 kv
  heads): the ring's relative error vs the float64 oracle must be at most 1.5x that of
  the single-GPU kernel ``ringflash.kernels.flash_attn`` run on the full sequence, plus
  a small absolute slack. The oracle at 4096 x W tokens runs one head at a time (an
  N x N float64 score matrix is 2 GiB at 16k) with the heads spread over the ranks; the
  squared errors are summed with an all-reduce, so the figures are exact over all heads.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import ringflash
from oracle import BF16, DTYPE_ID, F16, F32, LAYOUTS, attention_oracle, oracle_grads, rel_err
from ringflash.kernels import flash_attn

pytestmark = pytest.mark.gpu

NAMES = ("out", "lse", "dq", "dk", "dv")
# Against the float64 oracle. fp32 runs with TF32 off (IEEE dots); the GPU's exp2 is an
# approximation, hence not oracle.TOL's 1e-5 of the CPU.
TOL = {F32: 1e-4, F16: 2e-2, BF16: 2e-2}
RATIO = 1.5  # ring error <= RATIO * single-GPU error + SLACK
SLACK = {F32: 1e-5, F16: 1e-4, BF16: 1e-4}


@pytest.fixture(scope="module")
def nccl(nccl_world):
    """The NCCL world's device (conftest.nccl_world), TF32 off for the module: fp32 means
    IEEE fp32, kernels and oracle."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield nccl_world
    torch.backends.cuda.matmul.allow_tf32 = tf32


def _agree(failures: list[str]) -> None:
    """Fail on every rank if any rank has failures (one all-reduce, always reached)."""
    flag = torch.tensor([1 if failures else 0], device="cuda", dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if failures:
        pytest.fail(f"rank {dist.get_rank()}:\n" + "\n".join(failures))
    if flag.item():
        pytest.fail(f"rank {dist.get_rank()} passed, another rank failed (see its report)")


def _same_everywhere(shape, dtype, gen, device) -> torch.Tensor:
    """Random full-sequence data, identical on every rank (rank 0's, broadcast)."""
    t = torch.randn(shape, generator=gen, device=device).to(dtype)
    dist.broadcast(t, src=0)
    return t


def _inputs(batch, n, heads, kv_heads, head_dim, dtype, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = _same_everywhere((batch, n, heads, head_dim), dtype, gen, device)
    k = _same_everywhere((batch, n, kv_heads, head_dim), dtype, gen, device)
    v = _same_everywhere((batch, n, kv_heads, head_dim), dtype, gen, device)
    dout = _same_everywhere((batch, n, heads, head_dim), dtype, gen, device)
    dlse = _same_everywhere((batch, heads, n), torch.float32, gen, device)
    return q, k, v, dout, dlse


def _backward(out, lse, dout, dlse):
    """d/d(inputs) of sum(out * dout) + sum(lse * dlse)."""
    torch.autograd.backward([out, lse], [dout, dlse])


def run_ring(q, k, v, dout, dlse, *, causal, layout, softmax_scale=None, deterministic=False):
    """Ring forward + backward on this rank's shards; the gathered full-sequence results."""
    ql, kl, vl = (ringflash.shard(t, 1, layout).detach().requires_grad_() for t in (q, k, v))
    out, lse = ringflash.ring_flash_attn(ql, kl, vl, causal=causal, layout=layout,
                                         softmax_scale=softmax_scale, return_lse=True,
                                         deterministic=deterministic)
    _backward(out, lse, ringflash.shard(dout, 1, layout), ringflash.shard(dlse, 2, layout))
    got = {"out": out.detach(), "lse": lse.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    return {name: ringflash.unshard(t, 2 if name == "lse" else 1, layout) for name, t in got.items()}


def run_single(q, k, v, dout, dlse, *, causal, softmax_scale=None, triton=False):
    """The single-GPU kernel on the full sequence (triton=True: the Triton backward where
    Hopper's default is the Gluon one)."""
    from ringflash.kernels import dispatch
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = flash_attn(qs, ks, vs, causal=causal, softmax_scale=softmax_scale, return_lse=True)
    route = dispatch.bwd_route
    if triton:
        dispatch.bwd_route = lambda *args, **kwargs: dispatch.Route("triton", "the test asks for it")
    try:
        _backward(out, lse, dout, dlse)
    finally:
        dispatch.bwd_route = route
    return {"out": out.detach(), "lse": lse.detach(), "dq": qs.grad, "dk": ks.grad, "dv": vs.grad}


def single_errors(q, k, v, dout, dlse, errors, *, causal) -> dict:
    """The single GPU's error per result: the larger of its two backwards' (the Gluon one,
    which the ring's steps take where it serves them, and the Triton one, which takes the
    rest); ``errors(results)`` gives one run's errors by name."""
    runs = [errors(run_single(q, k, v, dout, dlse, causal=causal, triton=t)) for t in (False, True)]
    return {name: max(run[name] for run in runs) for name in NAMES}


def _not_finite(results: dict, who: str) -> list[str]:
    return [f"{who}: {name} has NaN or inf" for name, t in results.items()
            if not torch.isfinite(t).all()]


# Tests that compile the most kernel variants come first: tests/run_gpu.py hands the tests
# out in file order, and a long test taken last would end the run late.

# ----------------------------------------------------------------------------- heads x ring


@pytest.mark.parametrize("heads_world", [2, 4])
def test_heads_grid_matches_oracle(nccl, heads_world):
    """The heads x ring grid over NCCL (tests/test_heads.py's cases on CUDA, fp32) at
    U = heads_world where W allows it ((2, 1) on 2 GPUs; (2, 2) and (4, 1) on 4), the groups
    given as a pair at U = W and as a 2-D DeviceMesh otherwise."""
    from test_heads import check_grid
    world, rank = dist.get_world_size(), dist.get_rank()
    if heads_world > world or world % heads_world:  # the same on every rank
        pytest.skip(f"U = {heads_world} needs a multiple of {heads_world} GPUs")
    how = "pair" if heads_world == world else "mesh"
    # a ring of one (U = W) has one order whatever the layout: one run (with both, the test
    # took 146 s on 4 H200s)
    layouts = ("zigzag", "block_stripe") if heads_world < world else ("zigzag",)
    _agree(check_grid(rank, world, heads_world, layouts, how=how, device=nccl, tol=TOL[F32]))


# ----------------------------------------------------------------------------- small: vs fp64


def _oracle_cases(dtype):
    """(layout, causal, kv_heads): in bf16 every layout causal and not, MHA and GQA taking
    turns; in fp16 and fp32 every layout once, causal and GQA alternating (each case
    compiles its own kernel variants: the whole matrix in three dtypes took 70 s a dtype on
    2 H100s; the CPU suite runs the whole matrix)."""
    if dtype == BF16:
        return [(layout, causal, 2 if (i + causal) % 2 else 4)
                for i, layout in enumerate(LAYOUTS) for causal in (False, True)]
    return [(layout, i % 2 == 0, 2 if i % 2 else 4) for i, layout in enumerate(LAYOUTS)]


@pytest.mark.parametrize("half", [0, 1])
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=DTYPE_ID.get)
def test_ring_matches_fp64_oracle(nccl, dtype, half):
    """seqlen_local 512, 4 heads, lse in the loss: the cases of ``_oracle_cases``, every
    other one (two tests a dtype, which tests/run_gpu.py's worlds run at once)."""
    world = dist.get_world_size()
    failures = []
    for i, (layout, causal, kv_heads) in list(enumerate(_oracle_cases(dtype)))[half::2]:
        q, k, v, dout, dlse = _inputs(1, 512 * world, 4, kv_heads, 128, dtype, nccl, seed=i)
        ring = run_ring(q, k, v, dout, dlse, causal=causal, layout=layout)
        offset = 0 if causal else None
        out, lse = attention_oracle(q, k, v, causal_offset=offset)
        dq, dk, dv = oracle_grads(q, k, v, dout, causal_offset=offset, dlse=dlse)
        want = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
        single = single_errors(q, k, v, dout, dlse, lambda got: {n: rel_err(got[n], want[n]) for n in NAMES},
                               causal=causal)
        case = f"W={world} {layout} causal={causal} kv_heads={kv_heads} {DTYPE_ID[dtype]}"
        failures += _not_finite(ring, case)
        for name in NAMES:
            e_ring, e_single = rel_err(ring[name], want[name]), single[name]
            bound = min(TOL[dtype], RATIO * e_single + SLACK[dtype])
            if not e_ring <= bound:
                failures.append(f"{case}: {name} rel err {e_ring:.3g} > {bound:.3g} "
                                f"(single GPU {e_single:.3g})")
    _agree(failures)


def test_ring_backward_takes_the_gluon_kernel(nccl, monkeypatch):
    """On Hopper, bf16, head_dim 128, causal zigzag GQA: every block pair of the ring's
    backward runs the Gluon kernel (dQ and dK/dV in one call), by default and with
    deterministic=True (its dQ adds in a fixed order), whose gradients repeat their bits;
    the two agree within bf16 rounding (elsewhere: no Gluon call either way)."""
    from ringflash.kernels import dispatch
    calls = []
    gluon_bwd = dispatch.gluon_bwd
    monkeypatch.setattr(dispatch, "gluon_bwd", lambda *a, **kw: (calls.append(1), gluon_bwd(*a, **kw)))
    world = dist.get_world_size()
    q, k, v, dout, dlse = _inputs(1, 1024 * world, 8, 2, 128, BF16, nccl, seed=5)
    default = run_ring(q, k, v, dout, dlse, causal=True, layout="zigzag")
    served, calls[:] = len(calls), []
    runs = [run_ring(q, k, v, dout, dlse, causal=True, layout="zigzag", deterministic=True) for _ in range(2)]
    hopper = torch.cuda.get_device_capability() == (9, 0)
    failures = []
    for who, n in (("the default", served), ("deterministic=True", len(calls) // 2)):
        if hopper and n < 3:  # own step: two pieces, then a visiting step at least
            failures.append(f"{who} ran the Gluon kernel {n} times a backward")
        if not hopper and n:
            failures.append(f"the Gluon kernel ran on sm_{torch.cuda.get_device_capability()}")
    for name in NAMES:
        if not torch.equal(runs[0][name], runs[1][name]):
            failures.append(f"deterministic=True: {name} differs between two runs")
        err = rel_err(default[name], runs[0][name])
        if not err <= 1e-2:
            failures.append(f"{name}: default and deterministic differ by {err:.3g}")
    _agree(failures)


def _bf16_within_single(layout, got: dict, want: dict, single: dict) -> list:
    """Failures of the gathered bf16 ring results ``got`` against the oracle's ``want``: each
    within RATIO x the single GPU's error ``single`` + SLACK (and within TOL)."""
    failures = []
    for name in NAMES:
        err, bound = rel_err(got[name], want[name].cpu()), RATIO * single[name] + SLACK[BF16]
        if not err <= min(bound, TOL[BF16]):
            failures.append(f"{layout}: {name} rel err {err:.3g} > {RATIO} x single GPU {single[name]:.3g} "
                            f"+ {SLACK[BF16]:g} (or {TOL[BF16]:g})")
    return failures


@pytest.mark.parametrize("schedule", ["auto", "direct"])
@pytest.mark.parametrize("layout", ["documents", "zigzag", "documents-long"])
def test_packed_documents_take_the_gluon_kernels(nccl, layout, schedule, monkeypatch):
    """On Hopper, bf16, head_dim 128, causal packed documents (log-normal lengths, median
    300, the last 200 tokens padding; "documents-long": a few short ones, then one longer
    than every shard, split zigzag with its chunks meeting on tile boundaries, and
    padding), over the layout computed from them and over zigzag:
    the ring's forward and backward calls with segment ids run the Gluon kernels, the
    results are within 1.5x (+ slack) of the single GPU's error against the float64
    oracle, and padding rows stay exactly empty (elsewhere: no Gluon call). With
    RINGFLASH_SCHEDULE=direct, zigzag's whole shards (W >= 3) take the direct schedule."""
    monkeypatch.setenv("RINGFLASH_SCHEDULE", schedule)
    from oracle import global_mask, oracle_results
    from ringflash.kernels import dispatch
    from test_documents import _document_of, _lognormal
    from test_ring_masks import ring_results
    calls = {"fwd": 0, "bwd": 0}
    fwd_route, bwd_route = dispatch.fwd_route, dispatch.bwd_route

    def counted(route, name):
        def routed(*args, **kwargs):
            chosen = route(*args, **kwargs)
            calls[name] += chosen.name == dispatch.GLUON and kwargs["mask"].q_segments is not None
            return chosen
        return routed

    monkeypatch.setattr(dispatch, "fwd_route", counted(fwd_route, "fwd"))
    monkeypatch.setattr(dispatch, "bwd_route", counted(bwd_route, "bwd"))
    world, n = dist.get_world_size(), 512
    seqlen = n * world
    cu = (_lognormal(seqlen - 200, 300, seed=3) if layout != "documents-long"
          else torch.tensor([0, 5, 6, 7, 24, 27, seqlen - seqlen // 8]))
    ids = _document_of(cu, seqlen)[None].int()
    grid = ringflash.document_layout(cu, seqlen) if layout.startswith("documents") else layout
    q, k, v, dout, _ = _inputs(1, seqlen, 4, 2, 128, BF16, nccl, seed=11)
    local = [ringflash.shard(t, 1, grid).detach().requires_grad_() for t in (q, k, v)]
    got = ring_results(local, dout, grid, causal=True, segment_ids=ringflash.shard(ids.to(nccl), 1, grid))
    ring_calls = dict(calls)
    mask = global_mask(seqlen, True, segment_ids=ids).to(nccl)
    want = oracle_results(*(t.double() for t in (q, k, v, dout)), mask)
    single = {}
    for triton in (False, True):  # the single GPU's error: the larger of its two backwards'
        full = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = flash_attn(*full, causal=True, segment_ids=ids.to(nccl), return_lse=True)
        if triton:
            monkeypatch.setattr(dispatch, "bwd_route", lambda *a, **kw: dispatch.Route("triton", "the test asks"))
        out.backward(dout)
        for name, t in zip(NAMES, (out, lse, *(x.grad for x in full))):
            single[name] = max(single.get(name, 0.0), rel_err(t, want[name]))
    failures = []
    hopper = torch.cuda.get_device_capability() == (9, 0)
    for kind, count in ring_calls.items():
        if hopper and count < 1 or not hopper and count:
            failures.append(f"{layout}: {count} Gluon {kind} calls with segment ids on "
                            f"sm_{''.join(map(str, torch.cuda.get_device_capability()))}")
    failures += _bf16_within_single(layout, got, want, single)
    pad = ids[0] < 0
    if not ((got["out"][0, pad] == 0).all() and (got["dq"][0, pad] == 0).all() and (got["dk"][0, pad] == 0).all()):
        failures.append(f"{layout}: padding rows not exactly empty")
    _agree(failures)


@pytest.mark.parametrize("layout, causal", [("zigzag", True), ("block_stripe", False)])
def test_dropout_ring_takes_the_gluon_backward(nccl, layout, causal, monkeypatch):
    """On Hopper, bf16, head_dim 128, GQA with dropout 0.1 (the library's bits on global
    positions), causal zigzag and non-causal block_stripe (whose causal band compares
    global positions, which the Gluon kernels do not serve): the ring's backward calls with
    dropout run the Gluon kernel (zigzag's pieces and block_stripe's jumps aligned to the
    bits' blocks), and out, lse and the gradients are within 1.5x (+ slack) of the single
    GPU's error against the float64 oracle with the same keep mask (elsewhere: no Gluon
    call)."""
    from oracle import global_mask, oracle_results
    from ringflash.kernels import dispatch
    from ringflash.kernels.dropout import dropout_keep_mask, keep_scale
    from test_ring_masks import ring_results
    calls = [0]
    bwd_route = dispatch.bwd_route

    def counted(*args, **kwargs):
        chosen = bwd_route(*args, **kwargs)
        calls[0] += chosen.name == dispatch.GLUON and kwargs["mask"].dropout_p > 0
        return chosen

    monkeypatch.setattr(dispatch, "bwd_route", counted)
    world, p, seed = dist.get_world_size(), 0.1, 4321
    seqlen = 1024 * world
    q, k, v, dout, _ = _inputs(1, seqlen, 8, 2, 128, BF16, nccl, seed=13)
    local = [ringflash.shard(t, 1, layout).detach().requires_grad_() for t in (q, k, v)]
    got = ring_results(local, dout, layout, causal=causal, dropout_p=p, seed=seed)
    ring_calls = calls[0]
    dropped = (dropout_keep_mask(seed, p, 1, 8, seqlen).to(nccl), keep_scale(p))
    mask = global_mask(seqlen, causal)
    want = oracle_results(*(t.double() for t in (q, k, v, dout)), None if mask is None else mask.to(nccl), dropped)
    full = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attn(*full, causal=causal, dropout_p=p, seed=seed, return_lse=True)
    out.backward(dout)
    single = {name: rel_err(t, want[name]) for name, t in zip(NAMES, (out, lse, *(x.grad for x in full)))}
    failures = []
    hopper = torch.cuda.get_device_capability() == (9, 0)
    if hopper and ring_calls < world or not hopper and ring_calls:
        failures.append(f"{layout}: {ring_calls} Gluon backward calls with dropout on "
                        f"sm_{''.join(map(str, torch.cuda.get_device_capability()))}")
    failures += _bf16_within_single(layout, got, want, single)
    _agree(failures)


# ----------------------------------------------------------------------------- masks


# One configuration of tests/test_ring_masks.py per mechanism (the CPU suite runs all 13 at
# W = 1-4): each further one compiles kernel variants of its own, which a cold run pays for.
GPU_MASKS = ("docs", "padded", "window-across", "window+docs", "docs-bf16", "dropout+docs")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_masked_ring_matches_oracle(nccl, layout):
    """Segment ids (random documents, padding), sliding windows across ranks
    and dropout through the NCCL / copy-engine ring, 384 tokens per rank (several GPU
    tiles): the checks of tests/test_ring_masks.py on CUDA (``GPU_MASKS``)."""
    from test_ring_masks import check_masked_ring
    _agree(check_masked_ring(dist.get_rank(), dist.get_world_size(), layout, n=384, device=nccl,
                             names=GPU_MASKS))


@pytest.mark.parametrize("half", [0, 1])
def test_document_layout_matches_oracle(nccl, half):
    """tests/test_documents.py's configurations through NCCL, 384 tokens a rank, every other
    one (the whole list took 136 s from a cold cache on 4 H200s)."""
    from test_documents import check_document_ring
    _agree(check_document_ring(dist.get_rank(), dist.get_world_size(), n=384, device=nccl,
                               which=slice(half, None, 2)))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "block_stripe"])
def test_block_sparse_ring_matches_oracle(nccl, layout):
    """Block masks (random, per-head, local + window, strided + documents, causal with
    dropout; block_stripe without the window) through the NCCL / copy-engine ring, chunks
    of 256 tokens: the checks of tests/test_block_sparse.py on CUDA."""
    from test_block_sparse import check_block_sparse_ring
    _agree(check_block_sparse_ring(dist.get_rank(), dist.get_world_size(), layout, device=nccl,
                                   chunk=256))


@pytest.mark.parametrize("transport", ["peer", "nccl"])
def test_direct_schedule_matches_oracle(nccl, transport, monkeypatch):
    """The direct schedule (RINGFLASH_SCHEDULE=direct: each shard sent straight to every
    rank that computes it, all at once, partial dK/dV sums straight home) through both
    transports: the masks of ``test_masked_ring_matches_oracle`` on zigzag and block_stripe
    shards, every other document configuration, and the block masks on zigzag. It differs
    from the rotation from three ranks on."""
    from test_block_sparse import check_block_sparse_ring
    from test_documents import check_document_ring
    from test_ring_masks import check_masked_ring, with_schedule
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 3:  # the same on every rank
        pytest.skip("two ranks run the same schedule either way")
    monkeypatch.setenv("RINGFLASH_TRANSPORT", transport)
    failures = []
    for layout in ("zigzag", "block_stripe"):
        failures += with_schedule(rank, world, "direct", check_masked_ring, layout, n=384, device=nccl,
                                  names=GPU_MASKS)
    failures += with_schedule(rank, world, "direct", check_document_ring, n=384, device=nccl,
                              which=slice(0, None, 2))
    failures += with_schedule(rank, world, "direct", check_block_sparse_ring, "zigzag", device=nccl, chunk=256)
    _agree([f"{transport}: {f}" for f in failures])


# ----------------------------------------------------------------------------- large: vs single GPU


def oracle_error_sums(q, k, v, dout, dlse, candidates: dict, *, causal, softmax_scale=None):
    """Relative Frobenius errors of each candidate's out, lse, dq, dk, dv vs float64.

    The oracle runs one query head at a time; rank r takes kv heads r, r+W, ... with all
    their query heads (so it owns the whole dK/dV of those kv heads). Squared errors and
    squared reference norms are summed over the ranks' heads with one all-reduce.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    heads, kv_heads = q.shape[2], k.shape[2]
    group = heads // kv_heads
    offset = 0 if causal else None
    # sums[c, i]: squared error of candidate c in NAMES[i]; the last row: squared norm of the oracle.
    sums = torch.zeros(len(candidates) + 1, len(NAMES), dtype=torch.float64, device=q.device)

    def add(name, ref, pick):
        i = NAMES.index(name)
        for c, got in enumerate(candidates.values()):
            sums[c, i] += (pick(got[name]).double() - ref).square().sum()
        sums[-1, i] += ref.square().sum()

    for j in range(rank, kv_heads, world):
        kj, vj = (t[:, :, j:j + 1].double().requires_grad_() for t in (k, v))
        dk_ref = torch.zeros_like(kj)
        dv_ref = torch.zeros_like(vj)
        for h in range(j * group, (j + 1) * group):
            qh = q[:, :, h:h + 1].double().requires_grad_()
            out, lse = attention_oracle(qh, kj, vj, causal_offset=offset, softmax_scale=softmax_scale)
            dq, dk, dv = torch.autograd.grad(
                [out, lse], [qh, kj, vj], [dout[:, :, h:h + 1].double(), dlse[:, h:h + 1].double()])
            add("out", out.detach(), lambda t: t[:, :, h:h + 1])
            add("lse", lse.detach(), lambda t: t[:, h:h + 1])
            add("dq", dq, lambda t: t[:, :, h:h + 1])
            dk_ref += dk
            dv_ref += dv
            del out, lse, dq, dk, dv
        add("dk", dk_ref, lambda t: t[:, :, j:j + 1])
        add("dv", dv_ref, lambda t: t[:, :, j:j + 1])
    dist.all_reduce(sums)
    sums = sums.cpu()
    return {who: {name: math.sqrt(sums[c, i].item() / sums[-1, i].item()) for i, name in enumerate(NAMES)}
            for c, who in enumerate(candidates)}


# At 4096 tokens a rank the ring's error against the single GPU's: the main job's case
# (causal zigzag, GQA) and one of each other order of steps (contiguous without a mask,
# block_stripe causal). The small cases above run every layout, causal and not, against
# the oracle; each large case here compiles kernel variants of its own (the small tests
# and all nine large combinations took about 330 s from a cold cache on 4 H100s,
# 2026-11-27).
BIG_CASES = [("zigzag", True, 8), ("contiguous", False, 32), ("block_stripe", True, 32)]


@pytest.mark.parametrize("layout,causal,kv_heads", BIG_CASES,
                         ids=[f"{l}-{'causal' if c else 'full'}-kv{h}" for l, c, h in BIG_CASES])
def test_ring_bf16_no_worse_than_single_gpu(nccl, layout, causal, kv_heads):
    """bf16, seqlen_local 4096, 32 heads, head_dim 128: ring error <= 1.5x single-GPU error."""
    world = dist.get_world_size()
    q, k, v, dout, dlse = _inputs(1, 4096 * world, 32, kv_heads, 128, BF16, nccl,
                                  seed=100 + BIG_CASES.index((layout, causal, kv_heads)))
    ring = run_ring(q, k, v, dout, dlse, causal=causal, layout=layout)
    single = [run_single(q, k, v, dout, dlse, causal=causal, triton=t) for t in (False, True)]
    case = f"W={world} N={q.shape[1]} {layout} causal={causal} kv_heads={kv_heads} bf16"
    failures = _not_finite(ring, f"{case} ring") + sum((_not_finite(s, f"{case} single GPU") for s in single), [])
    errors = oracle_error_sums(q, k, v, dout, dlse, {"ring": ring, "gluon": single[0], "triton": single[1]},
                               causal=causal)
    errors["single"] = {name: max(errors["gluon"][name], errors["triton"][name]) for name in NAMES}
    del ring, single
    torch.cuda.empty_cache()
    for name in NAMES:
        e_ring, e_single = errors["ring"][name], errors["single"][name]
        bound = RATIO * e_single + SLACK[BF16]
        if not e_ring <= bound:
            failures.append(f"{case}: {name} rel err {e_ring:.3g} > {RATIO} x single GPU "
                            f"{e_single:.3g} + {SLACK[BF16]:g}")
        if not e_ring <= TOL[BF16]:
            failures.append(f"{case}: {name} rel err {e_ring:.3g} > {TOL[BF16]:g}")
    if dist.get_rank() == 0:
        print(f"\n{case}: " + ", ".join(
            f"{n} {errors['ring'][n]:.2e}/{errors['single'][n]:.2e}" for n in NAMES) + " (ring/single)")
    _agree(failures)


# ----------------------------------------------------------------------------- past 2**31


@pytest.mark.parametrize("transport", ["peer", "nccl"])
def test_shards_past_2_31_elements(nccl, transport, monkeypatch):
    """Shards past 2**31 elements (q, out, dout and dq of (9, 65536, 32, 128) bf16 on every
    rank, 2.4e9 elements; GQA 32/8, causal zigzag): batches 0 and 8 (the latter past
    element 2**31) of the ring's forward and backward equal, bit for bit, the ring run on
    that batch alone. With 32-bit offsets the kernels read and wrote out of bounds there."""
    monkeypatch.setenv("RINGFLASH_TRANSPORT", transport)
    b, n, heads, kv_heads, d = 9, 65536, 32, 8, 128
    gen = torch.Generator(device=nccl).manual_seed(1000 + dist.get_rank())
    q = torch.randn(b, n, heads, d, generator=gen, device=nccl, dtype=BF16)
    k, v = (torch.randn(b, n, kv_heads, d, generator=gen, device=nccl, dtype=BF16) for _ in range(2))
    dout = torch.randn_like(q)
    assert q.numel() > 2 ** 31
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    # deterministic: by default the Gluon backward's dQ adds in arrival order, which bit
    # equality cannot allow
    out = ringflash.ring_flash_attn(q, k, v, causal=True, deterministic=True)
    out.backward(dout)
    failures = []
    for i in (0, b - 1):
        one = [t[i:i + 1].detach().clone().requires_grad_() for t in (q, k, v)]
        out_i = ringflash.ring_flash_attn(*one, causal=True, deterministic=True)
        out_i.backward(dout[i:i + 1])
        for name, big, small in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad),
                                    (out_i, *(t.grad for t in one))):
            if not torch.equal(big[i:i + 1], small):
                diff = (big[i:i + 1].float() - small.float()).abs().max().item()
                failures.append(f"{transport}: {name} of batch {i} differs from its ring alone ({diff:.3g})")
    del q, k, v, dout, out
    torch.cuda.empty_cache()
    _agree(failures)


# ----------------------------------------------------------------------------- transports


@pytest.mark.parametrize("layout", LAYOUTS)
def test_transports_give_the_same_bits(nccl, layout, monkeypatch):
    """The copy-engine ring moves the same bytes as NCCL in the same order: every result,
    forward and backward, is bitwise equal (bf16, GQA, causal, seqlen_local 2048; then a
    longer call, which grows the symmetric buffers; deterministic, else the Gluon
    backward's dQ adds in arrival order)."""
    world = dist.get_world_size()
    failures = []
    for n in (2048, 4096):
        q, k, v, dout, dlse = _inputs(1, n * world, 8, 2, 128, BF16, nccl, seed=7 + n)
        results = {}
        for kind in ("nccl", "peer"):
            monkeypatch.setenv("RINGFLASH_TRANSPORT", kind)
            results[kind] = run_ring(q, k, v, dout, dlse, causal=True, layout=layout, deterministic=True)
        for name in NAMES:
            if not torch.equal(results["nccl"][name], results["peer"][name]):
                diff = (results["nccl"][name].float() - results["peer"][name].float()).abs().max().item()
                failures.append(f"W={world} n={n} {layout}: {name} differs between transports "
                                f"(max abs diff {diff:.3g})")
    _agree(failures)


def test_ranks_disagreeing_on_transport_raise(nccl, monkeypatch):
    """Rank 1 asks for NCCL, the others for peer copies: every rank raises, naming the
    field, and the next call works."""
    if dist.get_world_size() < 2:  # the same on every rank: no collective is left waiting
        pytest.skip("needs a rank 1 to disagree")
    q, k, v, dout, dlse = _inputs(1, 512 * dist.get_world_size(), 4, 4, 64, BF16, nccl, seed=3)
    ql, kl, vl = (ringflash.shard(t, 1, "zigzag") for t in (q, k, v))
    monkeypatch.setenv("RINGFLASH_TRANSPORT", "nccl" if dist.get_rank() == 1 else "peer")
    failures = []
    try:
        ringflash.ring_flash_attn(ql, kl, vl, causal=True, layout="zigzag")
        failures.append("no error raised")
    except ValueError as error:
        if "disagree on transport" not in str(error):
            failures.append(f"wrong error: {error}")
    monkeypatch.delenv("RINGFLASH_TRANSPORT")
    out = ringflash.ring_flash_attn(ql, kl, vl, causal=True, layout="zigzag")
    want = ringflash.shard(flash_attn(q, k, v, causal=True), 1, "zigzag")
    if not torch.allclose(out.float(), want.float(), atol=2e-2, rtol=2e-2):
        failures.append("the call after the error is wrong")
    _agree(failures)
