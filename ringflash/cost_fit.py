"""Fitting ``ringflash.cost``'s constants (``Costs``) to measurements:
``python benchmarks/predict_scaling.py --fit`` fits them to every committed 2- and 4-GPU
mask row it reads (docs/performance.md, "Cost model")."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .cost import H100, Costs, efficiency, rank_times

FITTED = ("tile_ms", "row_ms", "step_ms", "message_ms")


def fit(one_gpu: Sequence[tuple], rings: Sequence[tuple], start: Costs = H100, fitted: Sequence[str] = FITTED,
        iters: int = 300) -> tuple[Costs, float]:
    """(the constants, their rms relative error): the constants named in ``fitted`` fitted to
    measurements, the others held at ``start``'s. one_gpu: (counts at world 1, Problem,
    measured ms); rings: (ring counts, counts at world 1, Problem, measured efficiency).
    Least squares on the log of predicted over measured (1-GPU times and ring efficiencies
    alike), on the constants' logs (each must start positive) from ``start``: Adam, then
    L-BFGS from where it stopped (the max() of kernels and transfers is piecewise linear)."""
    names = list(fitted)
    logs = torch.tensor([math.log(getattr(start, name)) for name in names], dtype=torch.float64,
                        requires_grad=True)

    def errors() -> torch.Tensor:
        costs = start._replace(**dict(zip(names, logs.exp())))
        out = [torch.log(rank_times(c, costs, p)[0] / ms) for c, p, ms in one_gpu]
        out += [torch.log(efficiency(ring, one, costs, p) / eff) for ring, one, p, eff in rings]
        return torch.stack(out)

    def loss() -> torch.Tensor:
        opt.zero_grad()
        value = errors().square().mean()
        value.backward()
        return value

    opt = torch.optim.Adam([logs], lr=0.03)
    for _ in range(iters):
        opt.step(loss)
    opt = torch.optim.LBFGS([logs], lr=0.5, max_iter=200, line_search_fn="strong_wolfe")
    opt.step(loss)
    with torch.no_grad():
        rms = float(errors().square().mean().sqrt())
    return start._replace(**{name: float(v) for name, v in zip(names, logs.detach().exp())}), rms
