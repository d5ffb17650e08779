"""torch's context parallel as a peer of the ring benchmark (bench_ring.py).

``torch.distributed.tensor.experimental.context_parallel`` over a 1-D DeviceMesh of every
rank, SDPA restricted to one backend (``CP_BACKENDS``: the impl names bench_ring accepts):
each run is checked against ringflash's kernel on the full sequence (after gathering CP's
shards back into sequence order), then timed with the harness's ``timing.time_phases``. Its load
balancer (head-tail sharding, ringflash's zigzag) is on for causal runs only, since it
requires is_causal=True.
"""

from __future__ import annotations

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

