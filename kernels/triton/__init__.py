"""The Triton kernels (every CUDA GPU; the interpreter on CPU tensors), by role:

    tiles.py     shared @triton.jit helpers: loads, masks as column intervals, loop bounds,
                 dropout bits
    fwd.py       the forward kernel          bwd.py   the delta, dK/dV and dQ kernels
    segments.py  segment ranges on the GPU   config.py tile shapes per head_dim and dtype
    sums.py      fp32 sums added and rounded once (``add_rounded``)
    launch.py    the launchers ``fwd``, ``bwd``, ``delta``: the backend interface that
                 kernels/pair.py calls (kernels/reference.py is its PyTorch twin)
"""

from .launch import bwd, delta, fwd
from .segments import segment_ranges
from .sums import add_rounded

__all__ = ["add_rounded", "bwd", "delta", "fwd", "segment_ranges"]
