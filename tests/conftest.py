"""Test session setup: Triton's interpreter on CPU-only machines, `gpu` tests skipped there,
and the tests of a module that run in spawned gloo worlds grouped by world size.

Triton chooses between compiling and interpreting when a kernel is decorated, i.e. when
ringflash.kernels is first imported (triton's knobs read the environment lazily), so
TRITON_INTERPRET must be set before anything imports ringflash. The interpreter runs without
its repeated patching (tests/fast_interpreter.py).
"""

import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

if not HAS_CUDA:
    if "ringflash.kernels.triton.launch" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("ringflash.kernels was imported before tests/conftest.py could set "
                           "TRITON_INTERPRET=1: its Triton kernels are already compiled-mode")
    os.environ["TRITON_INTERPRET"] = "1"
    import fast_interpreter  # noqa: E402 - after TRITON_INTERPRET is set
    fast_interpreter.install()


if "PYTEST_XDIST_WORKER" in os.environ:
    # One intra-op thread per xdist worker (pytest -n auto runs a worker per core, besides the
    # spawned gloo ranks, which take one each): two OpenMP threads a worker on two cores wait
    # on each other. tests/test_layouts.py with -n 2 on the 2-core machine: 71 s -> 24 s.
    torch.set_num_threads(1)


def pytest_configure(config):
    # numpy >= 1.25 warns inside triton 3.6's interpreter at every loop bound: noise, not news.
    config.addinivalue_line(
        "filterwarnings", "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")


def world_size_of(item) -> int:
    """The size of the spawned world a test runs in: its ``world(n)`` marker or its
    ``world_size`` parameter; 0 for a test that uses no ``worlds`` fixture."""
    marker = item.get_closest_marker("world")
    if marker is not None:
        return marker.args[0]
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "world_size" in params:
        return params["world_size"]
    if "worlds" in getattr(item, "fixturenames", ()):
        raise pytest.UsageError(f"{item.nodeid} uses the worlds fixture: give it a world_size "
                                "parameter or a @pytest.mark.world(n) marker")
    return 0


def pytest_collection_modifyitems(config, items):
    # Within each module, tests that need no world first, then those of world size 1, 2, ...
    # (a stable sort: file order otherwise), so that the module-scoped ``worlds`` fixture
    # spawns each size once instead of whenever consecutive tests change sizes.
    modules: dict = {}
    for item in items:
        modules.setdefault(getattr(item, "module", None), []).append(item)
    items[:] = [item for group in modules.values() for item in sorted(group, key=world_size_of)]
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


@pytest.fixture
def seed():
    """Seed torch's CPU (and CUDA) generators; returns the seed."""
    torch.manual_seed(0)
    return 0


@pytest.fixture(scope="module")
def worlds():
    """Spawned gloo worlds (dist_utils.Worlds): one world size at a time, reused while
    consecutive tests of a module ask for the same size, closed at the module's end.
    A test that uses it declares its size (a ``world_size`` parameter or
    ``@pytest.mark.world(n)``), by which its module's tests are grouped."""
    from dist_utils import Worlds
    cache = Worlds()
    yield cache
    cache.close()


@pytest.fixture(scope="session")
def nccl_world():
    """The NCCL world of this torchrun launch, made once a session: its device.

    Skips without CUDA or outside torchrun. Once, not a module at a time: a world destroyed
    and made again on torchrun's store, which outlives it, gets the old world's group name
    and store keys, and a rank that reads the NCCL id before rank 0 has written the new one
    joins the dead communicator (4 x H200, 2026-11-28: three ranks 300 s in
    ``init_process_group`` when a world went from tests/test_heads_gpu.py to
    tests/test_ring_gpu.py). A world that some test made already is left to it."""
    import torch.distributed as dist
    from datetime import timedelta

    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    if not all(name in os.environ for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK")):
        pytest.skip("multi-GPU test: run under torchrun (WORLD_SIZE/RANK/LOCAL_RANK unset)")
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(name, "0" if name == "NCCL_NVLS_ENABLE" else "1")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    owner = not dist.is_initialized()
    if owner:
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=5))
    yield device
    if owner and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
