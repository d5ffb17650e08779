"""Test session setup: Triton's interpreter on CPU-only machines, `gpu` tests skipped there.

Triton chooses between compiling and interpreting when a kernel is decorated, i.e. when
ringflash.kernels is first imported (triton's knobs read the environment lazily), so
TRITON_INTERPRET must be set before anything imports ringflash.
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


def pytest_configure(config):
    # numpy >= 1.25 warns inside triton 3.6's interpreter at every loop bound: noise, not news.
    config.addinivalue_line(
        "filterwarnings", "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")


def pytest_collection_modifyitems(config, items):
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
    consecutive tests of a module ask for the same size, closed at the module's end."""
    from dist_utils import Worlds
    cache = Worlds()
    yield cache
    cache.close()
