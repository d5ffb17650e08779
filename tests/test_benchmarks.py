"""The benchmark scripts' CPU smoke runs: they finish, name the device they measured, label
the backend and the unit truthfully, and write outside benchmarks/results.

Each script runs in a subprocess (bench_ring under torchrun, 2 gloo ranks) with TMPDIR
pointing into pytest's temporary directory, so the temporary directory a smoke run writes
to by default lands there. Every file under benchmarks/results must be byte-identical
afterwards, and git must see no change there.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from oracle import LAYOUTS
from dist_utils import run_command

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"


def _digests() -> dict[str, str]:
    return {str(p.relative_to(RESULTS)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(RESULTS.rglob("*")) if p.is_file()}


def _git_status() -> str | None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    done = subprocess.run(["git", "status", "--porcelain", "--", "benchmarks/results"], cwd=ROOT,
                          capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def _run(cmd: list[str], tmp_path: Path, timeout: float = 120) -> str:
    rc, out = run_command(cmd, ROOT, timeout, TMPDIR=str(tmp_path), PYTHONUNBUFFERED="1")
    assert rc == 0, f"{' '.join(cmd)} failed ({rc}):\n{out[-4000:]}"
    return out


@pytest.fixture
def results_untouched():
    before, status = _digests(), _git_status()
    yield
    assert _digests() == before, "a smoke run changed files under benchmarks/results"
    assert _git_status() == status


def _written(tmp_path: Path, name: str) -> dict:
    """The one results file ``name`` a smoke run wrote into a temporary directory."""
    found = list(tmp_path.glob(f"ringflash-bench-*/{name}"))
    assert len(found) == 1, f"expected one {name} under {tmp_path}, found {found}"
    return json.loads(found[0].read_text())


def test_bench_kernel_cpu_smoke(tmp_path, results_untouched):
    out = _run([sys.executable, str(BENCH / "bench_kernel.py"), "--device", "cpu"], tmp_path)
    data = _written(tmp_path, "kernel_cpu.json")
    assert data["meta"]["device"].startswith("cpu") and data["meta"]["gpu_count"] == 0
    assert {r["impl"] for r in data["records"]} == {"ringflash", "sdpa_flash"}
    assert all(r["fwd_tflops"] and r["fwdbwd_tflops"] for r in data["records"])
    assert "GFLOP/s (CPU)" in out and "TFLOP/s" not in out


def test_bench_ring_cpu_smoke_under_torchrun(tmp_path, results_untouched):
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                "--max-restarts=0", str(BENCH / "bench_ring.py"), "--device", "cpu", "--no-plot"],
               tmp_path)
    data = _written(tmp_path, "ring_cpux2.json")
    meta = data["meta"]
    assert meta["device"].startswith("cpu") and meta["world_size"] == 2 and meta["backend"] == "gloo"
    ring = [r for r in data["records"] if r["impl"] == "ringflash"]
    assert ring and all(r["transport"] == "gloo" and r["fwdbwd_tflops_per_gpu"] for r in ring)
    assert "nccl" not in out.lower()
    assert "per GPU" not in out and "TF/GPU" not in out and "TFLOP/s/GPU" not in out


def test_bench_balance_cpu_smoke(tmp_path, results_untouched):
    _run([sys.executable, str(BENCH / "bench_balance.py"), "--device", "cpu"], tmp_path)
    data = _written(tmp_path, "balance_cpux1.json")
    assert data["meta"]["device"].startswith("cpu") and data["meta"]["backend"] == "gloo"
    assert {r["layout"] for r in data["records"]} == set(LAYOUTS)
    assert all(r["transport"] == "gloo" for r in data["records"])


def test_sass_loops_compiles_without_a_gpu(tmp_path, results_untouched):
    """The static instruction counts of benchmarks/NOTES.md come from compiling for sm_90 here."""
    import triton
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia",
                                       "bin", "nvdisasm")):
        pytest.skip("this triton ships no nvdisasm")
    out = _run([sys.executable, str(BENCH / "sass_loops.py"), "--kernels", "dq"], tmp_path)
    plain, drop = (int(re.search(rf"dq +{kind} .* tile loop (\d+) instructions", out).group(1))
                   for kind in ("plain", "dropout"))
    assert 0 < plain < drop, out


def test_block_sparse_loop_prefetches_like_dense(tmp_path, results_untouched):
    """The loop over a block mask's full blocks (the sparse kernels' last) buffers its tiles
    as deep as the dense loops do: with the launch's stages, Triton's pipeliner spends one
    level on the index list and the forward ran 14-26% slower (benchmarks/NOTES.md)."""
    import triton
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia",
                                       "bin", "nvdisasm")):
        pytest.skip("this triton ships no nvdisasm")
    out = _run([sys.executable, str(BENCH / "sass_loops.py"), "--kernels", "fwd", "dq", "--sparse"],
               tmp_path)
    for which in ("fwd", "dq"):
        dense, sparse = (json.loads(re.search(rf"{which} +{kind} .* tile buffers (\[.*\])", out).group(1))
                         for kind in ("plain", "sparse"))
        assert sparse[-2:] == [max(dense)] * 2, (which, dense, sparse)


def _rows_by_flag(script: str, tmp_path: Path) -> dict[str, tuple[int, ...]]:
    """Run ``script`` with benchmarks/ importable; its lines that start with "False" or
    "True" as {their first word: the integers after it}."""
    out = _run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(BENCH)!r})\n" + script], tmp_path)
    return dict((flag, tuple(map(int, rest))) for flag, *rest in (line.split() for line in out.splitlines()
                                                                 if line.startswith(("False", "True"))))


def test_accumulating_forward_keeps_the_tile_loop(tmp_path):
    """The ring's accumulating forward (merging into running sums) compiles, dropout on, to
    the plain forward's tile loop, registers and stack: resuming from the sums held their
    addresses through the loops (255 registers, a stack) and ran 13-17% slower under
    dropout on an H200 (benchmarks/NOTES.md, "Dropout, fifth round")."""
    import triton
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia",
                                       "bin", "nvdisasm")):
        pytest.skip("this triton ships no nvdisasm")
    script = ("import collections, re, sass_loops as S\n"
              "for acc in (False, True):\n"
              "    kernel, _ = S.compile_kernel('fwd', 128, dropout=True, accumulate=acc)\n"
              "    usage = S._tool('cuobjdump', kernel.asm['cubin'], '--dump-resource-usage')\n"
              "    loop = S.tile_loop(S._tool('nvdisasm', kernel.asm['cubin'], '-c'))\n"
              "    print(acc, re.search(r'REG:(\\d+)', usage).group(1), re.search(r'STACK:(\\d+)', usage).group(1),\n"
              "          len(loop))\n")
    rows = _rows_by_flag(script, tmp_path)
    (plain_regs, plain_stack, plain_loop), (regs, stack, loop) = rows["False"], rows["True"]
    assert stack == plain_stack == 0 and loop == plain_loop and regs <= plain_regs + 2, rows


HOPPER_SHARED_BYTES = 227 * 1024  # the most dynamic shared memory one block can have


def test_every_masked_variant_fits_hopper_shared_memory(tmp_path):
    """Compiled for sm_90 here (no GPU): the heaviest variant of each kernel, band, segment
    ids, a block mask and dropout at once, head_dim 128, asks no more shared memory than a
    Hopper block has. The forward with segments and a block mask once asked 320 KB: its
    launch failed on the GPU and nothing on the CPU noticed."""
    import triton
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton ships no ptxas")
    script = ("from sass_loops import compile_kernel\n"  # compiles, whatever TRITON_INTERPRET says
              "for which in ('fwd', 'dq', 'dkdv'):\n"
              "    kernel, _ = compile_kernel(which, 128, dropout=True, sparse=True, band=True, segments=True)\n"
              "    print(which, 'shared', kernel.metadata.shared)\n")
    out = _run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(BENCH)!r})\n" + script], tmp_path)
    shared = dict(re.findall(r"(\w+) shared (\d+)", out))
    assert sorted(shared) == ["dkdv", "dq", "fwd"], out
    for which, size in shared.items():
        assert int(size) <= HOPPER_SHARED_BYTES, (which, size)


def test_gluon_forward_attempt_compiles_for_hopper(tmp_path):
    """The warp-specialized Gluon forward of kernel_attempts.py (benchmarks/NOTES.md,
    "Dropout, seventh round" and "eighth round") builds for sm_90 here, without dropout,
    with it, with the bits drawn by a warp group of their own and with the consumers taking
    turns: no stack, its shared memory within a Hopper block's, the dropout bits joined into
    the accumulator's registers without a layout conversion (the kernel asserts it)."""
    import triton
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")):
        pytest.skip("this triton ships no nvdisasm")
    script = ("import re, sass_loops as S, kernel_attempts as K\n"  # sass_loops turns the interpreter off
              "for drop, stages, rng, pp in ((False, 3, 0, 0), (True, 3, 0, 0), (True, 2, 1, 0), (True, 3, 0, 1)):\n"
              "    kernel = K.gluon_compile(drop, stages, 'group' if rng else 'consumers', bool(pp))\n"
              "    usage = S._tool('cuobjdump', kernel.asm['cubin'], '--dump-resource-usage')\n"
              "    sass = S._tool('nvdisasm', kernel.asm['cubin'], '-c')\n"
              "    print(f'{drop}-{rng}{pp}', re.search(r'STACK:(\\d+)', usage).group(1), kernel.metadata.shared,\n"
              "          sass.count('IMAD.HI'), sass.count('HGMMA'), sass.count('SYNCS.ARRIVE'), sass.count('STS'))\n")
    rows = _rows_by_flag(script, tmp_path)
    assert len(rows) == 4, rows
    for stack, shared, _, hgmma, _, _ in rows.values():
        assert stack == 0 and shared <= HOPPER_SHARED_BYTES and hgmma > 0, rows
    plain, drop, rng, pingpong = (rows[k] for k in ("False-00", "True-00", "True-10", "True-01"))
    assert drop[2] >= plain[2] + 56, rows  # Philox's 7 rounds x 2 x 4 calls a tile
    assert rng[2] >= plain[2] + 56 and rng[5] > plain[5] and rng[4] == plain[4] + 1, rows  # the bits group
    assert pingpong[4] == plain[4] + 2, rows  # each consumer hands the turn to the other


def test_layout_picture_covers_every_layout():
    """plot_layouts.py's data (its drawing needs matplotlib, not in the test extras): every
    layout, every token owned, and the ranks' causal work adding up to the triangle."""
    sys.path.insert(0, str(BENCH))
    try:
        import plot_layouts as P
    finally:
        sys.path.remove(str(BENCH))
    for layout in LAYOUTS:
        assert sorted(set(P.owner_map(layout))) == list(range(P.WORLD)), layout
        n = P.SEQLEN * P.unit(layout)
        work = P.causal_work(layout)
        assert sum(work) == n * (n + 1) // 2, layout
        if layout != "contiguous":
            assert max(work) / min(work) < 1.3, (layout, work)


def test_result_names_come_from_the_device():
    sys.path.insert(0, str(BENCH))
    try:
        import _harness as H
    finally:
        sys.path.remove(str(BENCH))
    names = {"NVIDIA H200": "h200", "NVIDIA H100 80GB HBM3": "h100", "NVIDIA A100-SXM4-80GB": "a100",
             "NVIDIA GeForce RTX 4090": "rtx4090", "NVIDIA H200 NVL": "h200", "NVIDIA L40S": "l40s"}
    for name, slug in names.items():
        assert H.gpu_slug(name) == slug, name
    import torch
    cpu = torch.device("cpu")
    assert H.result_name("kernel", cpu) == "kernel_cpu"
    assert H.result_name("ring", cpu, 2) == "ring_cpux2"
    assert H.results_dir(None, smoke=False) == RESULTS
    assert H.results_dir("elsewhere", smoke=True) == Path("elsewhere")


def test_plot_lines_tell_dropout_rates_apart():
    """One line per implementation, layout and dropout rate: the dropout plots drew p = 0 and
    p = 0.1 as one zigzag line."""
    sys.path.insert(0, str(BENCH))
    try:
        import _harness as H
    finally:
        sys.path.remove(str(BENCH))
    assert H.default_label({"impl": "ringflash", "layout": "zigzag"}) == "ringflash (zigzag)"
    assert H.default_label({"impl": "ringflash", "layout": "zigzag", "dropout_p": 0.0}) == "ringflash (zigzag) p=0"
    assert H.default_label({"impl": "sdpa_cudnn", "dropout_p": 0.1}) == "sdpa_cudnn p=0.1"


def test_tune_kernel_sets_the_tiles_of_one_kernel():
    """tune_kernel's stand-ins for fwd_config / bwd_config take the arguments the launches
    pass them (a stand-in without bwd_config's block-mask flag made every backward candidate
    fail) and change the swept kernel's tiles only, until the sweep leaves it."""
    sys.path.insert(0, str(BENCH))
    try:
        import tune_kernel
    finally:
        sys.path.remove(str(BENCH))
    import torch
    from ringflash.kernels.triton import config as T
    cfg = dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)
    fwd = T.fwd_config(128, torch.bfloat16)
    for sparse in (False, True):
        dkdv, dq = T.bwd_config(128, torch.bfloat16, sparse)
        with tune_kernel.tiles("dkdv", cfg):
            assert T.bwd_config(128, torch.bfloat16, sparse) == (cfg, dq)
            assert T.fwd_config(128, torch.bfloat16) == fwd
        with tune_kernel.tiles("dq", cfg):
            assert T.bwd_config(128, torch.bfloat16, sparse=sparse) == (dkdv, cfg)
        assert T.bwd_config(128, torch.bfloat16, sparse) == (dkdv, dq)
    with tune_kernel.tiles("fwd", cfg):
        assert T.fwd_config(128, torch.bfloat16) == cfg
    assert T.fwd_config(128, torch.bfloat16) == fwd
