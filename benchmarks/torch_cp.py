"""torch's context parallel as a peer of the ring benchmark (bench_ring.py).

``torch.distributed.tensor.experimental.context_parallel`` over a 1-D DeviceMesh of every
rank, SDPA restricted to one backend (``CP_BACKENDS``: the impl names bench_ring accepts):
each run is checked against ringflash's kernel on the full sequence (after gathering CP's
shards back into sequence order), then timed with the harness's ``timing.time_phases``. Its load
balancer (head-tail sharding, ringflash's zigzag) is on for causal runs only, since it
requires is_causal=True.

``run_flex_cp`` is bench_masks.py's peer for masked rings: torch CP's FlexAttention path with
its per-document head-tail balancer (packed documents) or head-tail (causal).
"""

from __future__ import annotations

import sys
import traceback
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from harness import checks, timing

if TYPE_CHECKING:
    from bench_ring import Cfg, Ctx

CP_BACKENDS = {"torch_cp_flash": "FLASH_ATTENTION", "torch_cp_cudnn": "CUDNN_ATTENTION"}


def get_mesh(ctx: Ctx):
    """The run's 1-D DeviceMesh over every rank, made once; its failure is kept and raised again."""
    if ctx.mesh is None and ctx.mesh_error is None:
        try:
            from torch.distributed.device_mesh import init_device_mesh

            ctx.mesh = init_device_mesh(ctx.device.type, (ctx.world,), mesh_dim_names=("cp",))
        except Exception as exc:  # noqa: BLE001 - the torch CP rows become null
            ctx.mesh_error = f"DeviceMesh: {checks.short_error(exc)}"
    if ctx.mesh is None:
        raise RuntimeError(ctx.mesh_error)
    return ctx.mesh


def _cp_modules():
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental import _attention as cp_attention

    return context_parallel, cp_attention


def _headtail_positions(seqlen: int, world: int, rank: int, load_balanced: bool) -> torch.Tensor:
    """Global positions of a rank's tokens under torch CP's sharding: head-tail is
    ringflash's zigzag, no load balancing its contiguous."""
    from ringflash.layouts import global_positions
    return global_positions(seqlen, "zigzag" if load_balanced else "contiguous", rank, world)


def _cp_unshard(tensors: list, seqlen: int, load_balanced: bool, ctx: Ctx, cp_attention):
    """Full-sequence (B, H, S, D) copies of CP's local outputs, on every rank."""
    try:
        return list(cp_attention.context_parallel_unshard(get_mesh(ctx), tensors, [2] * len(tensors))), "torch"
    except Exception:  # noqa: BLE001 - fall back to our own copy of its sharding rule
        fulls = []
        for t in tensors:
            t = t.contiguous()
            parts = [torch.empty_like(t) for _ in range(ctx.world)]
            dist.all_gather(parts, t, group=ctx.group)
            full = torch.empty((*t.shape[:2], seqlen, *t.shape[3:]), device=t.device, dtype=t.dtype)
            for r, part in enumerate(parts):
                full.index_copy_(2, _headtail_positions(seqlen, ctx.world, r, load_balanced).to(t.device), part)
            fulls.append(full)
        return fulls, "own head-tail rule"


def run_torch_cp(impl: str, cfg: Cfg, full, ref: Optional[dict], ctx: Ctx, args) -> dict:
    """torch context_parallel over a 1-D mesh, SDPA restricted to one backend.

    GQA: tries SDPA's enable_gqa=True first; if that fails or gives a wrong result, repeats
    K/V to the query heads (what a user of torch CP would do) and says so in the note.
    """
    modes = ["enable_gqa", "repeat_kv"] if cfg.kv_heads != cfg.heads else ["mha"]
    wrong = ctx.cp_wrong_modes.setdefault((impl, cfg.heads, cfg.kv_heads, cfg.causal), set())
    notes = [f"{m}: skipped, wrong at the checked seqlen" for m in modes if m in wrong]
    modes = [m for m in modes if m not in wrong]
    partial = None  # a failed attempt that still timed one phase
    res = {"layout": None, "error": "not run"}
    for mode in modes:
        try:
            res = _run_torch_cp_once(impl, mode, cfg, full, ref, ctx, args)
        except Exception as exc:  # noqa: BLE001 - never crash the run for a peer
            res = {"layout": None, "error": checks.short_error(exc)}
            timing.free_memory(ctx.device)
        ok = res.get("error") is None and not res.get("wrong")
        if not timing.all_ranks_ok(ok, ctx.group, ctx.device):
            why = res.get("wrong") or res.get("error") or "failed on another rank"
            notes.append(f"{mode}: {why}")
            ctx.log(f"  {cfg.tag} {impl} [{mode}] failed: {why}")
            if res.get("wrong"):
                wrong.add(mode)
            if partial is None and not res.get("wrong") and (res.get("fwd_ms") or res.get("fwdbwd_ms")):
                partial = dict(res, note=f"mode {mode}")
            continue
        if mode == "repeat_kv":
            notes.append("repeat_kv: K/V repeated to the query heads (enable_gqa path unusable)")
        elif mode == "enable_gqa":
            notes.append("enable_gqa=True")
        res["note"] = "; ".join(notes) or None
        return res
    if partial is not None:  # keep the phase that worked, say why the other is missing
        partial["error"] = "; ".join(notes)
        return partial
    return {"layout": res.get("layout"), "error": "; ".join(notes) or res.get("error")}


def _run_torch_cp_once(impl: str, mode: str, cfg: Cfg, full, ref, ctx: Ctx, args) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    context_parallel, cp_attention = _cp_modules()
    mesh = get_mesh(ctx)
    cp_attention.set_rotate_method(args.rotate_method)
    # Its load balancer (head-tail) requires is_causal=True; off for non-causal runs.
    cp_attention._cp_options.enable_load_balance = cfg.causal
    backend = getattr(SDPBackend, CP_BACKENDS[impl])
    group_size = cfg.heads // cfg.kv_heads
    sdpa_kwargs = {"enable_gqa": True} if mode == "enable_gqa" else {}

    q, k, v, do = full
    if mode == "repeat_kv":
        k, v = (t.repeat_interleave(group_size, dim=2) for t in (k, v))
    # Plain full-sequence tensors in SDPA's layout (B, H, S, D); the context manager shards
    # them in place along dim 2 (no_restore: nobody uses them after the context).
    bufs = [t.transpose(1, 2).contiguous() for t in (q, k, v, do)]
    del k, v

    def call(q_, k_, v_):
        return torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, is_causal=cfg.causal, **sdpa_kwargs)

    res = {"error": None}
    with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs)):
        load_balanced = bool(cp_attention._cp_options.enable_load_balance)
        res["layout"] = "headtail" if load_balanced else "contiguous"
        qs, ks, vs, dos = bufs
        with sdpa_kernel(backend):
            if ref is not None:
                local = checks.out_and_grads(call, (qs, ks, vs), dos)
                got, how = _cp_unshard(list(local.values()), cfg.seqlen, load_balanced, ctx, cp_attention)
                del local
                out_f, dq_f, dk_f, dv_f = got
                if mode == "repeat_kv":  # the repeated heads' grads add up to the kv head's grad
                    dk_f, dv_f = (g.unflatten(1, (cfg.kv_heads, group_size)).sum(2) for g in (dk_f, dv_f))
                errs = {n: checks.rel_err(a.transpose(1, 2), ref[n])
                        for n, a in (("out", out_f), ("dq", dq_f), ("dk", dk_f), ("dv", dv_f))}
                errs = {n: timing.allreduce_max(e, ctx.group, ctx.device) for n, e in errs.items()}
                del got, out_f, dq_f, dk_f, dv_f
                res["rel_err"] = errs["out"]
                bad = checks.failed_checks(errs, args.tol, args.grad_tol)
                if bad:
                    res["wrong"] = "WRONG RESULT: " + "; ".join(bad) + f" (unshard: {how})"
                    return res
            # Inputs of the timed calls are CP's local shards, views of the resized buffers.
            res.update(timing.time_phases(call, (qs, ks, vs), dos, device=ctx.device, group=ctx.group,
                                          **timing.timing_opts(args)))
    return res


# ----------------------------------------------------------------------------- FlexAttention under CP (bench_masks)
#
# bench_masks.py's peer for masked rings: torch CP's FlexAttention path, the module-wrapper
# API (``_context_parallel_shard`` shards Q/K/V and the BlockMask after its load balancer
# reorders them; a ``_ContextParallel(FLEX)`` hook all-gathers K/V before the local
# flex_attention and reduce-scatters dK/dV after it). No ring: every rank sees the whole K/V.
# Its per-document balancer orders the sequence document by document (each document's
# head-tail chunks in rank order) and the shards are contiguous pieces of that order, so a
# rank holds whole documents rather than a head and a tail of each: ``imbalance`` says how
# much more than the mean the busiest rank computes.

FLEX_IMPL = "torch_cp_flex"
FLEX_BALANCERS = {"documents": "per_document_headtail", "causal": "headtail", "window": "contiguous"}
_flex_state: dict = {}  # compiled flex_attention and create_block_mask, the 1-D mesh: once per process


class _Wrong(RuntimeError):
    """The peer's result differs from ringflash's: its row says so, with null times."""


def _imbalance(order: torch.Tensor, lengths: list[int], world: int) -> float:
    """The busiest rank's visible (query, key) pairs over the mean, causal within documents of
    ``lengths``, where rank r holds the r-th contiguous piece of positions ``order``."""
    bounds = torch.tensor([0, *lengths]).cumsum(0)
    pos = torch.arange(int(bounds[-1]))
    seen = pos - bounds[torch.searchsorted(bounds, pos, right=True) - 1] + 1
    per_rank = seen[order.long().cpu()].view(world, -1).sum(1).double()
    return float(per_rank.max() / per_rank.mean())


def cp_document_lengths(lengths: list[int], world: int) -> list[int]:
    """``lengths`` as torch CP's per-document balancer takes them: each a multiple of
    2 x world (it cuts every document into 2 x world equal chunks, a head and a tail per
    rank) and at least one such unit, the total kept (the longest documents give or take
    the difference); unchanged where no such split of the total exists (the balancer then
    refuses them, and the row says so)."""
    unit, total = 2 * world, sum(lengths)
    if total % unit or len(lengths) * unit > total:
        return list(lengths)
    out = [max(unit, unit * round(n / unit)) for n in lengths]
    while (diff := total - sum(out)) != 0:
        i = max(range(len(out)), key=out.__getitem__)
        out[i] += diff if diff > 0 else -min(-diff, out[i] - unit)
    return out


def _flex_setup(device: torch.device, world: int):
    """(flex_attention and create_block_mask compiled for static shapes, the 1-D "cp"
    DeviceMesh over every rank), made once. The recompile limit is raised: each (mask,
    length) is its own graph, and past the limit flex_attention would run eager (the whole
    score matrix)."""
    if "flex" not in _flex_state:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
        _flex_state["mesh"] = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
        _flex_state["flex"] = torch.compile(flex_attention, dynamic=False)
        _flex_state["block_mask"] = torch.compile(create_block_mask, dynamic=False)
    return _flex_state["flex"], _flex_state["block_mask"], _flex_state["mesh"]


def run_flex_cp(full, dout, mask_mod, reference, *, mask: str, lengths=None, group, args,
                tol: float = 2e-2, grad_tol: float = 5e-2) -> dict:
    """torch CP's FlexAttention path on ``full`` = q, k, v (1, S, H, D), the same on every rank,
    under ``mask_mod`` (global positions) with the balancer of ``FLEX_BALANCERS[mask]``
    (per document: its ``_PerDocumentHeadTailLoadBalancer`` over ``lengths``, each a multiple
    of 2 x world, ``cp_document_lengths``). Checked against ``reference(q, k, v)`` (ringflash on
    the full sequence, (1, S, H, D): out, dq, dk, dv against ``dout``; out alone on the CPU, where
    FlexAttention has no backward) after gathering the shards back into sequence order, then
    timed (``timing.timed``).

    Fails soft and in step: setup (the reference, the BlockMasks and shards, then
    flex_attention compiled on the local shapes with no collective in flight), check and
    timing each end with every rank agreeing (``timing.all_ranks_ok``) before the next starts;
    a failure or a wrong result becomes ``error`` with null times. Returns fwd_ms, fwdbwd_ms,
    check_rel_err, check_grad_rel_err, layout, imbalance (causal and documents), error, note."""
    device, world = full[0].device, dist.get_world_size(group)
    grads = device.type == "cuda"
    res = dict(fwd_ms=None, fwdbwd_ms=None, check_rel_err=None, check_grad_rel_err=None,
               layout=FLEX_BALANCERS[mask], imbalance=None, error=None,
               note=None if grads else "forward only: FlexAttention has no backward on the CPU")
    st: dict = {}

    def setup():
        from torch.distributed.tensor.experimental import _attention as cp
        from torch.distributed.tensor.parallel import parallelize_module

        st["ref"] = checks.out_and_grads(reference, full, dout, grads=grads)
        flex, create_block_mask, mesh = _flex_setup(device, world)
        seqlen = full[0].shape[1]
        balancer = {"per_document_headtail": lambda: cp._PerDocumentHeadTailLoadBalancer([lengths], world, device),
                    "headtail": lambda: cp._HeadTailLoadBalancer(seqlen, world, device),
                    "contiguous": lambda: None}[res["layout"]]()
        if mask != "window":
            order = balancer._generate_indices()[0] if balancer is not None else torch.arange(seqlen)
            res["imbalance"] = _imbalance(order, lengths or [seqlen], world)
        block_mask = create_block_mask(mask_mod, 1, 1, seqlen, seqlen, device=device)
        heads_first = [t.transpose(1, 2).contiguous() for t in (*full, dout)]  # flex's (B, H, S, D)
        *local, local_mask = cp._context_parallel_shard(mesh, heads_first + [block_mask], [2] * 5,
                                                         load_balancer=balancer)

        class Attention(torch.nn.Module):  # older torch's hook passes score_mod, block_mask by position
            def forward(self, q, k, v, score_mod=None, block_mask=None):
                return flex(q, k, v, score_mod=score_mod, block_mask=block_mask)

        plan = cp._ContextParallel(seq_dim=2, attention_type=cp._ContextParallel.AttentionType.FLEX)
        module = parallelize_module(Attention(), mesh, plan)
        st.update(cp=cp, mesh=mesh, balancer=balancer, local=local,
                  attention=lambda q, k, v: module(q, k, v, block_mask=local_mask))
        # Compile here, on the shapes the hook hands it (local Q, whole K/V), no collective in flight.
        checks.out_and_grads(lambda q, k, v: flex(q, k, v, block_mask=local_mask),
                             (local[0], *heads_first[1:3]), local[3], grads=grads)

    def check():
        got = checks.out_and_grads(st["attention"], st["local"][:3], st["local"][3], grads=grads)
        gathered = st["cp"].context_parallel_unshard(st["mesh"], list(got.values()), [2] * len(got),
                                                     load_balancer=st["balancer"])
        ref = st.pop("ref")
        errs = {n: checks.rel_err(g.transpose(1, 2), ref[n]) for n, g in zip(got, gathered)}
        res["check_rel_err"] = errs["out"]
        res["check_grad_rel_err"] = max((e for n, e in errs.items() if n != "out"), default=None)
        bad = checks.failed_checks(errs, tol, grad_tol)
        if bad:
            raise _Wrong("WRONG RESULT: " + "; ".join(bad))

    def measure():
        q, k, v = (t.detach().requires_grad_(grads) for t in st["local"][:3])
        if grads:
            res["fwd_ms"], res["fwdbwd_ms"] = timing.timed(st["attention"], q, k, v, device, args, group=group)
        else:
            with torch.no_grad():
                res["fwd_ms"] = timing.bench_ms(lambda: st["attention"](q, k, v), device=device,
                                                rep_ms=args.rep_ms, group=group)

    for stage, fn in (("setup", setup), ("check", check), ("timing", measure)):
        try:
            fn()
            ok = True
        except Exception as exc:  # noqa: BLE001 - a peer never stops the run
            res["error"] = str(exc) if isinstance(exc, _Wrong) else f"{stage}: {checks.short_error(exc)}"
            if not isinstance(exc, _Wrong):  # the whole story, in this rank's log
                print(f"[rank {dist.get_rank()}] {FLEX_IMPL} {mask}:\n{traceback.format_exc()[-3000:]}",
                      file=sys.stderr)
            ok = False
        if not timing.all_ranks_ok(ok, group, device):  # every rank here: say what failed where
            errors = [None] * world
            dist.all_gather_object(errors, res["error"], group=group)
            first = next((r for r, e in enumerate(errors) if e), None)
            res.update(fwd_ms=None, fwdbwd_ms=None, error=f"{errors[first]} (rank {first})" if first is not None
                       else f"{stage}: failed")
            break
    st.clear()
    timing.free_memory(device)
    return res
