"""Correctness before timing: every script compares an implementation's output (and
gradients) with a reference on the same inputs before it times it, so that a fast wrong
result is never reported."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch


def out_and_grads(call: Callable, inputs: Sequence[torch.Tensor], dout: torch.Tensor,
                  grads: bool = True) -> dict:
    """{"out", "dq", "dk", "dv"} of ``call(q, k, v)`` and its backward against ``dout``, on
    fresh leaves over ``inputs`` (no copies); only "out" without ``grads``."""
    leaves = [t.detach().requires_grad_(grads) for t in inputs]
    with torch.set_grad_enabled(grads):
        out = call(*leaves)
        if grads:
            out.backward(dout)
    got = {"out": out.detach()}
    if grads:
        got.update(dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
    return got


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative Frobenius error ||a - e|| / ||e||, in fp32, of two tensors of one shape."""
    if actual.shape != expected.shape:
        raise ValueError(f"shape mismatch: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    a, e = actual.float(), expected.float()
    num = torch.linalg.vector_norm(a - e).item()
    den = torch.linalg.vector_norm(e).item()
    if not math.isfinite(num) or not math.isfinite(den):
        return float("inf")
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def sharded_rel_errs(pairs: dict, group, device: torch.device) -> dict:
    """rel_err of each (actual, expected) pair of ``pairs`` over the whole of tensors sharded
    across the ranks of ``group`` (the same on every rank)."""
    from .timing import allreduce_sum

    sums = []
    for actual, expected in pairs.values():
        a, e = actual.float(), expected.float()
        sums.extend(((a - e).pow(2).sum().item(), e.pow(2).sum().item()))
    sums = allreduce_sum(sums, group, device)
    out = {}
    for i, name in enumerate(pairs):
        num, den = sums[2 * i], sums[2 * i + 1]
        out[name] = math.sqrt(num / den) if den > 0 and math.isfinite(num) else float("inf")
    return out


def failed_checks(errs: dict[str, float], tol: float, grad_tol: float) -> list[str]:
    """The relative errors above tolerance: ``tol`` for "out", ``grad_tol`` for the rest."""
    limits = {n: tol if n == "out" else grad_tol for n in errs}
    return [f"{n} rel err {e:.3g} > {limits[n]:g}" for n, e in errs.items() if not e <= limits[n]]


def short_error(exc: BaseException, limit: int = 300) -> str:
    """The exception's type and first line, as a record's ``error`` says it."""
    msg = str(exc).strip().splitlines()
    first = msg[0] if msg else ""
    text = f"{type(exc).__name__}: {first}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class WrongResult(RuntimeError):
    """ringflash gave a wrong result: the run stops (exit 3), reporting nothing."""


def abort_banner(message: str, what: str) -> str:
    """What a script prints to stderr before it exits 3 on a wrong result of ``what``
    ("a kernel", "a ring")."""
    bar = "!" * 78
    return f"\n{bar}\nABORT: {message}\nNo numbers are reported for {what} that is not correct.\n{bar}"
