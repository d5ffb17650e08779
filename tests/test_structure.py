"""The library's shape, read from its source (tools/imports.py): no import circles, imports
pointing one way down the floors of docs/design.md, the kernels knowing nothing of the
distributed layer, no library file over 600 lines, no kernel taking more than ~25 loose
arguments (they travel grouped, in the records of kernels/triton/tiles.py)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import imports  # noqa: E402

sys.path.remove(str(ROOT / "tools"))

# docs/design.md, "Layout of the repository": each may import those after it, never before.
FLOORS = ("hf", "parallel", "layer", "api", "heads", "ops", "ring", "exchange", "layouts")


def _floor(module: str) -> int | None:
    for i, name in enumerate(FLOORS):
        if module == f"ringflash.{name}" or module.startswith(f"ringflash.{name}."):
            return i
    return None


def test_tools_imports_reads_every_module():
    names = set(imports.modules())
    assert {"ringflash.api", "ringflash.ring.rotate", "ringflash.kernels.triton.fwd",
            "ringflash.kernels.op"} <= names
    edges = imports.graph()
    assert "ringflash.kernels.triton" in edges["ringflash.kernels.dispatch"]  # from . import triton
    assert "ringflash.agreement" in edges["ringflash.ops"]  # from . import agreement


def test_no_import_circles():
    assert imports.circles(imports._package_edges(imports.graph())) == []


def test_imports_point_down_the_floors():
    for module, targets in imports.graph().items():
        here = _floor(module)
        for target in targets:
            there = _floor(target)
            if here is not None and there is not None:
                assert there >= here, f"{module} imports {target}, a floor above it"


def test_kernels_know_nothing_of_the_distributed_layer():
    for module, targets in imports.graph().items():
        if module.startswith("ringflash.kernels"):
            assert all(t.startswith("ringflash.kernels") for t in targets), (module, targets)


def test_library_files_are_short():
    long = {name: n for name, path in imports.modules().items()
            if (n := len(path.read_text().splitlines())) > 600}
    assert not long, long


def test_kernels_take_their_arguments_grouped():
    for path in sorted((ROOT / "kernels" / "triton").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                n = len(node.args.args)
                assert n <= 25, f"{path.name}: {node.name} takes {n} arguments"
