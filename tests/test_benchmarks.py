"""The benchmark scripts' CPU smoke runs and the tools the measurement notes rely on.

Smoke runs: each script runs in a subprocess (bench_ring under torchrun, 2 gloo ranks) from
a directory outside the checkout, with TMPDIR pointing into pytest's temporary directory,
so the temporary directory a smoke run writes to by default lands there. They finish, name
the device they measured, label the backend and the unit truthfully, and write outside
benchmarks/results: every file there must be byte-identical afterwards, and git must see
no change there. The GPU-only scripts must at least build their command line here.

tools/sass_loops.py compiles the kernels for sm_90 without a GPU; its command line and the
static checks built on it share two processes that run side by side, so each kernel variant
is compiled once.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from oracle import LAYOUTS
from dist_utils import run_command

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
TOOLS = ROOT / "tools"
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


@contextlib.contextmanager
def _results_untouched():
    before, status = _digests(), _git_status()
    yield
    assert _digests() == before, "a run changed files under benchmarks/results"
    assert _git_status() == status


@pytest.fixture
def results_untouched():
    with _results_untouched():
        yield


def _run(cmd: list[str], tmp_path: Path, timeout: float = 120) -> str:
    """stdout+stderr of ``cmd`` run from ``tmp_path`` (not the checkout: the scripts must
    not depend on the working directory), which is also its TMPDIR; it must succeed."""
    rc, out = run_command(cmd, tmp_path, timeout, TMPDIR=str(tmp_path), PYTHONUNBUFFERED="1")
    assert rc == 0, f"{' '.join(cmd)} failed ({rc}):\n{out[-4000:]}"
    return out


def _load(folder: Path, name: str):
    """Module ``name`` imported as the scripts of ``folder`` see it (``folder`` on sys.path)."""
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(folder))


def _written(tmp_path: Path, name: str) -> dict:
    """The one results file ``name`` a smoke run wrote into a temporary directory."""
    found = list(tmp_path.glob(f"ringflash-bench-*/{name}"))
    assert len(found) == 1, f"expected one {name} under {tmp_path}, found {found}"
    return json.loads(found[0].read_text())


# ----------------------------------------------------------------------------- smoke runs


def test_bench_kernel_cpu_smoke(tmp_path, results_untouched):
    out = _run([sys.executable, str(BENCH / "bench_kernel.py"), "--device", "cpu"], tmp_path)
    data = _written(tmp_path, "kernel_cpu.json")
    assert data["meta"]["device"].startswith("cpu") and data["meta"]["gpu_count"] == 0
    assert {r["impl"] for r in data["records"]} == {"ringflash", "sdpa_flash"}
    assert all(r["fwd_tflops"] and r["fwdbwd_tflops"] for r in data["records"])
    assert "GFLOP/s (CPU)" in out and "TFLOP/s" not in out


def test_bench_ring_cpu_smoke_under_torchrun(tmp_path, results_untouched):
    # 256 tokens rather than the smoke run's 1k: the same configurations (MHA and GQA,
    # causal and not, the ring and the 1-process kernel), a sixteenth of the attention work;
    # the ring alone and the heads x ring grid of 2 x 1.
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                "--max-restarts=0", str(BENCH / "bench_ring.py"), "--device", "cpu", "--no-plot",
                "--seqlens", "256", "--heads-parallel", "1", "2"], tmp_path)
    data = _written(tmp_path, "ring_cpux2.json")
    meta = data["meta"]
    assert meta["device"].startswith("cpu") and meta["world_size"] == 2 and meta["backend"] == "gloo"
    ring = [r for r in data["records"] if r["impl"] == "ringflash"]
    assert ring and all(r["transport"] == "gloo" and r["fwdbwd_tflops_per_gpu"] for r in ring)
    assert {(r["heads_parallel"], r["ring"]) for r in ring} == {(1, 2), (2, 1)}
    assert "nccl" not in out.lower()
    assert "per GPU" not in out and "TF/GPU" not in out and "TFLOP/s/GPU" not in out


def test_bench_ring_profiles_a_grid_call_with_documents(tmp_path, results_untouched):
    # --profile on the heads x ring grid (U = 2 over 2 gloo ranks) with packed documents:
    # every rank writes its trace, rank 0 prints the breakdown; no results file.
    trace = tmp_path / "trace.json"
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                "--max-restarts=0", str(BENCH / "bench_ring.py"), "--device", "cpu", "--profile-only",
                "--profile", str(trace), "--profile-mask", "documents", "--profile-heads-parallel", "2",
                "--profile-seqlen", "512", "--heads", "4"], tmp_path)
    assert trace.exists() and (tmp_path / "trace.rank1.json").exists()
    assert "docs" in out and "grid 2 x 1" in out and "From the trace" in out
    assert not list(tmp_path.glob("ringflash-bench-*/*.json"))


def test_bench_masks_ring_cpu_smoke_under_torchrun(tmp_path, results_untouched):
    # Packed documents at 768 tokens over 3 gloo ranks, both schedules: the ring's rows with
    # their efficiency and the cost model's rows. torch CP's FlexAttention row is left out
    # here: compiling FlexAttention for the CPU takes a minute (its rows were run on 4 H200s).
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
          "--max-restarts=0", str(BENCH / "bench_masks.py"), "--ring", "--device", "cpu",
          "--masks", "documents", "--seqlens", "768", "--torch-cp", "--schedules", "rotate", "direct",
          "--layouts", "documents", "zigzag", "block_stripe"], tmp_path, timeout=600)
    records = _written(tmp_path, "masks_cpux3.json")["records"]
    ring = [r for r in records if r["impl"] == "ringflash"]
    assert sorted((r["layout"], r["schedule"]) for r in ring) == sorted(
        (layout, schedule) for layout in ("documents", "zigzag", "block_stripe") for schedule in ("rotate", "direct"))
    assert all(r["gpus"] == 3 and r["efficiency"] > 0 for r in ring)
    assert all(r["direct"] == (r["schedule"] == "direct" and r["ring_steps"] >= 3) for r in ring), ring
    model = [r for r in records if r["impl"] == "cost_model"]
    assert sorted((r["layout"], r["schedule"]) for r in model) == sorted((r["layout"], r["schedule"]) for r in ring)
    assert all(0 < r["predicted_efficiency"] <= 1 for r in model)
    assert not [r for r in records if r["impl"] == "torch_cp_flex"]


def test_bench_masks_efficiency_and_predicted_rows():
    """bench_masks.py --ring's derived rows, without a run: every multi-GPU row's
    ``efficiency`` from the same run's 1-GPU row, the cost model's row per ring row, and the
    document lengths torch CP's per-document balancer is given."""
    import argparse
    masks = _load(BENCH, "bench_masks")
    args = argparse.Namespace(heads=32, head_dim=128, window=4096, documents_seed=0, documents_median=2048)
    seqlen = 16384
    records = []
    for mask in ("causal", "documents", "window"):
        visible = masks.case_mask(mask, seqlen, args.window, "cpu")[1]
        records.append(masks.record("ringflash_1gpu", mask, seqlen, args.window, visible, 2.0, 8.0, args))
        for layout in ("documents" if mask == "documents" else "zigzag", "block_stripe"):
            records.append(masks.record("ringflash", mask, seqlen, args.window, visible, 1.0, 5.0, args,
                                        world=2, layout=layout))
    records.append(masks.record("torch_cp_flex", "documents", seqlen, args.window, 1, None, None, args, world=2))
    masks.add_efficiency(records)
    ring = [r for r in records if r["impl"] == "ringflash"]
    assert all(r["efficiency"] == pytest.approx(8.0 / (2 * 5.0)) for r in ring)
    assert "efficiency" not in records[-1]
    import torch

    from ringflash import cost
    assert masks.model_constants(torch.device("cpu"), args) is cost.H100  # the Triton kernels' rates
    model = masks.predicted(records, 2, args)
    assert [(r["mask"], r["layout"]) for r in model] == [(r["mask"], r["layout"]) for r in ring]
    assert all(r["impl"] == "cost_model" and r["gpus"] == 2 and 0 < r["predicted_efficiency"] <= 1 for r in model)
    lengths = masks.torch_cp.cp_document_lengths([100, 301, 23, 600], 2)
    assert lengths == [100, 300, 24, 600]
    assert masks.torch_cp.cp_document_lengths([3, 3], 2) == [3, 3]  # no split: left for the balancer to refuse


def test_bench_masks_bytes_leave_out_the_kept_kv():
    """A ring row's bytes: where the direct schedule keeps the K/V its forward received
    (through NCCL, shards cut), the backward's second trip of them is not counted; the
    rotation, or whole shards, count both trips, and the rotation carries every row a shard
    sends any rank, where the direct schedule sends each rank only the rows it sees."""
    import argparse

    import torch

    import ringflash
    from ringflash import cost
    masks = _load(BENCH, "bench_masks")
    args = argparse.Namespace(heads=4, head_dim=16)
    lengths = [48, 16, 6, 58, 8, 47, 31, 42]  # over 4 ranks: 3 steps, shards cut
    mask = cost.Mask.documents(lengths)
    layout = ringflash.document_layout(torch.tensor(mask.cu_seqlens), 256, world=4)
    direct, rotate = (cost.ring_counts(4, 256, layout, mask, schedule=s) for s in ("auto", "rotate"))
    assert direct.direct and direct.cut and not rotate.direct
    row = cost.kv_bytes(1, cost.Problem(4, 4, 16))
    kept, again = masks.bytes_sent(direct, args, kept=True), masks.bytes_sent(direct, args)
    busiest = int(direct.received.sum(1).argmax())  # the rank receiving most counts either way here
    assert again - kept == row * int(direct.received[busiest].sum()) > 0
    assert masks.bytes_sent(rotate, args, kept=True) == masks.bytes_sent(rotate, args) > again


def test_bench_balance_cpu_smoke(tmp_path, results_untouched):
    _run([sys.executable, str(BENCH / "bench_balance.py"), "--device", "cpu"], tmp_path)
    data = _written(tmp_path, "balance_cpux1.json")
    assert data["meta"]["device"].startswith("cpu") and data["meta"]["backend"] == "gloo"
    assert {r["layout"] for r in data["records"]} == set(LAYOUTS)
    assert all(r["transport"] == "gloo" for r in data["records"])


def test_balance_documents_writes_outside_results(tmp_path, monkeypatch, capsys, results_untouched):
    """The CPU count behind docs/masks-and-layouts.md's imbalance figures, on a short
    sequence: it writes into a new temporary directory unless told otherwise."""
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    _load(BENCH, "balance_documents").main(["--seqlen", "16k", "--draws", "2"])
    data = _written(tmp_path, "balance_documents.json")
    assert {r["layout"] for r in data["records"]} == set(LAYOUTS)
    assert all(r["imbalance_worst"] >= r["imbalance_mean"] >= 1.0 for r in data["records"])
    assert "wrote " + str(tmp_path) in capsys.readouterr().out


@pytest.mark.parametrize("script", [f"benchmarks/{name}" for name in (
    "bench_kernel", "bench_ring", "bench_balance", "bench_masks", "bench_dropout", "bench_blocksparse",
    "balance_documents", "plot", "plot_layouts", "bench_scale")] + ["tools/tune_kernel"])
def test_scripts_build_their_command_line(script, monkeypatch, capsys):
    """Every script imports and answers --help without a GPU (the GPU-only ones can be run
    nowhere else here)."""
    folder, name = (ROOT / script).parent, Path(script).name
    module = _load(folder, name)
    main = getattr(module, "parse_args", None) or module.main
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--help"])  # for a main() that reads sys.argv
    with pytest.raises(SystemExit) as done:
        main(["--help"]) if inspect.signature(main).parameters else main()
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("usage: ")


def test_chunk_rule_pairs_every_setting_measured_both_ways(capsys):
    """benchmarks/research/chunk_rule.py finds each setting the committed chunk files hold
    with one chunk and with two, and prints the rule's choice for each."""
    module = _load(BENCH / "research", "chunk_rule")
    found = module.pairs()
    assert len(found) == 8 and all(one["head_chunks"] == 1 and two["head_chunks"] == 2 for _, one, two in found)
    assert all(all(one[k] == two[k] for k in module.KEY) for _, one, two in found)
    module.main()
    out = capsys.readouterr().out
    assert out.count(" right") + out.count(" wrong") == 8 and "mesh_h200x4_chunks_gqa.json" in out


def test_bench_scale_counts_what_any_attention_keeps():
    """bench_scale's ``kept_gib``: q, out, dout, dq (32 heads) and k, v, dk, dv (8 kv heads)
    of 128 bf16 elements a row, lse in fp32: 41,088 bytes a token."""
    scale = _load(BENCH, "bench_scale")
    assert scale.kept_bytes(1, 32, 8, 128) == 128 * 2 * (4 * 32 + 4 * 8) + 4 * 32 == 41088
    assert scale.kept_bytes(1 << 20, 32, 8, 128) == 41088 << 20


# ----------------------------------------------------------------------------- sm_90 compiles

SASS_SCRIPT = r'''
import re, sys, traceback
import sass_loops as S  # turns Triton's interpreter off: compiles for sm_90


def cli():  # the command line: the plain, dropout and block-sparse loops of the forward and dQ
    S.main(["--kernels", "fwd", "dq", "--sparse"])


def accumulate():  # the ring's accumulating forward beside the plain one, dropout on
    for acc in (False, True):
        kernel, _ = S.compile_kernel("fwd", 128, dropout=True, accumulate=acc)
        usage = S._tool("cuobjdump", kernel.asm["cubin"], "--dump-resource-usage")
        loop = S.tile_loop(S._tool("nvdisasm", kernel.asm["cubin"], "-c"))
        print(acc, re.search(r"REG:(\d+)", usage).group(1), re.search(r"STACK:(\d+)", usage).group(1),
              len(loop))


def ones():  # integer arguments equal to 1 reach a kernel as Python ints (Triton specializes
    # them): a sequence in two parts whose first part is one row, a dropout threshold of 1
    q, k, v, dout, out, lse, delta = S._inputs(64, seqlen=256, heads=4, kv_heads=4)
    with S.compiling() as made:
        S._joined_launches(q, k, v, dout, out, lse, delta, S._mask(256, 4, sparse=True), False, split=1)
        S.kernels.fwd(q, k, v, out, lse, softmax_scale=0.125, accumulate=False,
                      mask=S._mask(256, 4)._replace(dropout_p=1 / 256))
    print(" ".join(name for name, _ in made))


def shared():  # the heaviest variant of each kernel
    for which in ("fwd", "dq", "dkdv"):
        kernel, _ = S.compile_kernel(which, 128, dropout=True, sparse=True, band=True, segments=True)
        print(which, "shared", kernel.metadata.shared)


for part in sys.argv[1:]:
    print(f"== {part}", flush=True)
    try:
        globals()[part]()
    except Exception:
        traceback.print_exc(file=sys.stdout)
        print("== failed", flush=True)
'''
# Two processes side by side, about the same compile work each; the second's accumulate
# runs last, when the first has compiled (and Triton cached) the plain dropout forward.
SASS_PROCESSES = (("cli",), ("shared", "accumulate", "ones"))


@pytest.fixture(scope="module")
def sass(tmp_path_factory) -> dict[str, str]:
    """What SASS_SCRIPT printed, by part (cli, accumulate, shared): each kernel variant that
    two checks look at is compiled once, and the compiles run in two processes at once."""
    import triton
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    missing = [t for t in ("ptxas", "nvdisasm", "cuobjdump") if not (bin_dir / t).exists()]
    if missing:
        pytest.skip(f"this triton ships no {', '.join(missing)}")
    script = f"import sys; sys.path.insert(0, {str(TOOLS)!r})\n" + SASS_SCRIPT

    def run(parts):
        return _run([sys.executable, "-c", script, *parts], tmp_path_factory.mktemp("sass"), timeout=600)

    with _results_untouched(), ThreadPoolExecutor(len(SASS_PROCESSES)) as pool:
        out = "".join(pool.map(run, SASS_PROCESSES))
    return dict(re.findall(r"^== (\w+)\n(.*?)(?=^== \w+\n|\Z)", out, re.M | re.S))


def _part(sass: dict[str, str], name: str) -> str:
    text = sass.get(name, "")
    if not text or "== failed" in text:
        pytest.fail(f"sass_loops, {name}:\n{text[-4000:]}")
    return text


def _rows_by_flag(text: str) -> dict[str, tuple[int, ...]]:
    """The lines of ``text`` that start with "False" or "True" as {that word: the integers after it}."""
    return dict((flag, tuple(map(int, rest))) for flag, *rest in (line.split() for line in text.splitlines()
                                                                 if line.startswith(("False", "True"))))


def test_sass_loops_compiles_without_a_gpu(sass):
    """The static instruction counts of docs/notes/ (dropout.md, documents.md) come from
    compiling for sm_90 here."""
    out = _part(sass, "cli")
    plain, drop = (int(re.search(rf"dq +{kind} .* tile loop (\d+) instructions", out).group(1))
                   for kind in ("plain", "dropout"))
    assert 0 < plain < drop, out


def test_block_sparse_loop_prefetches_like_dense(sass):
    """The loop over a block mask's full blocks (the sparse kernels' last) buffers its tiles
    as deep as the dense loops do: with the launch's stages, Triton's pipeliner spends one
    level on the index list and the forward ran 14-26% slower (docs/notes/block-sparse.md,
    "Block-sparse, second round")."""
    out = _part(sass, "cli")
    for which in ("fwd", "dq"):
        dense, sparse = (json.loads(re.search(rf"{which} +{kind} .* tile buffers (\[.*\])", out).group(1))
                         for kind in ("plain", "sparse"))
        assert sparse[-2:] == [max(dense)] * 2, (which, dense, sparse)


def test_accumulating_forward_keeps_the_tile_loop(sass):
    """The ring's accumulating forward (merging into running sums) compiles, dropout on, to
    the plain forward's tile loop, registers and stack: resuming from the sums held their
    addresses through the loops (255 registers, a stack) and ran 13-17% slower under
    dropout on an H200 (docs/notes/dropout.md, "Dropout, fifth round")."""
    rows = _rows_by_flag(_part(sass, "accumulate"))
    (plain_regs, plain_stack, plain_loop), (regs, stack, loop) = rows["False"], rows["True"]
    assert stack == plain_stack == 0 and loop == plain_loop and regs <= plain_regs + 2, rows


HOPPER_SHARED_BYTES = 227 * 1024  # the most dynamic shared memory one block can have


def test_every_masked_variant_fits_hopper_shared_memory(sass):
    """Compiled for sm_90 here (no GPU): the heaviest variant of each kernel, band, segment
    ids, a block mask and dropout at once, head_dim 128, asks no more shared memory than a
    Hopper block has. The forward with segments and a block mask once asked 320 KB: its
    launch failed on the GPU and nothing on the CPU noticed."""
    out = _part(sass, "shared")
    shared = dict(re.findall(r"(\w+) shared (\d+)", out))
    assert sorted(shared) == ["dkdv", "dq", "fwd"], out
    for which, size in shared.items():
        assert int(size) <= HOPPER_SHARED_BYTES, (which, size)


# ----------------------------------------------------------------------------- in-process


def test_layout_picture_covers_every_layout():
    """plot_layouts.py's data (its drawing needs matplotlib, not in the test extras): every
    layout, every token owned, and the ranks' causal work adding up to the triangle."""
    P = _load(BENCH, "plot_layouts")
    for layout in LAYOUTS:
        assert sorted(set(P.owner_map(layout))) == list(range(P.WORLD)), layout
        n = P.SEQLEN * P.unit(layout)
        work = P.causal_work(layout)
        assert sum(work) == n * (n + 1) // 2, layout
        if layout != "contiguous":
            assert max(work) / min(work) < 1.3, (layout, work)


def test_result_names_come_from_the_device():
    results = _load(BENCH, "harness.results")
    names = {"NVIDIA H200": "h200", "NVIDIA H100 80GB HBM3": "h100", "NVIDIA A100-SXM4-80GB": "a100",
             "NVIDIA GeForce RTX 4090": "rtx4090", "NVIDIA H200 NVL": "h200", "NVIDIA L40S": "l40s"}
    for name, slug in names.items():
        assert results.gpu_slug(name) == slug, name
    import torch
    cpu = torch.device("cpu")
    assert results.result_name("kernel", cpu) == "kernel_cpu"
    assert results.result_name("ring", cpu, 2) == "ring_cpux2"
    assert results.results_dir(None, smoke=False) == RESULTS
    assert results.results_dir("elsewhere", smoke=True) == Path("elsewhere")
    smoke = results.results_dir(None, smoke=True)
    try:
        assert smoke.is_dir() and RESULTS not in (smoke, *smoke.parents)
    finally:
        smoke.rmdir()


def test_plot_lines_tell_dropout_rates_apart():
    """One line per implementation, layout and dropout rate: the dropout plots drew p = 0 and
    p = 0.1 as one zigzag line."""
    plots = _load(BENCH, "harness.plots")
    assert plots.default_label({"impl": "ringflash", "layout": "zigzag"}) == "ringflash (zigzag)"
    assert plots.default_label({"impl": "ringflash", "layout": "zigzag", "dropout_p": 0.0}) == "ringflash (zigzag) p=0"
    assert plots.default_label({"impl": "sdpa_cudnn", "dropout_p": 0.1}) == "sdpa_cudnn p=0.1"
    # a comparison run's trees: ringflash's lines apart, a peer's one line (its latest run)
    assert plots.default_label({"impl": "ringflash", "layout": "zigzag", "variant": "old", "dropout_p": 0.1}) == \
        "ringflash (zigzag), old p=0.1"
    assert plots.default_label({"impl": "sdpa_cudnn", "variant": "old"}) == "sdpa_cudnn"


def test_tune_kernel_sets_the_tiles_of_one_kernel():
    """tune_kernel's stand-ins for fwd_config / bwd_config take the arguments the launches
    pass them (a stand-in without bwd_config's block-mask flag made every backward candidate
    fail) and change the swept kernel's tiles only, until the sweep leaves it."""
    tune_kernel = _load(TOOLS, "tune_kernel")
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


def test_kernels_compile_with_arguments_equal_to_one(sass):
    """Triton turns an integer argument equal to 1 into a constant (a Python int inside the
    kernel), which has no ``.to``: the backward of a sequence in two parts whose first part
    is one row (the document layout at 4 GPUs made one) and dropout of rate 1/256 (drop
    threshold 1) failed to compile on the GPU while the interpreter, which specializes
    nothing, ran them."""
    assert _part(sass, "ones").split() == ["_fwd_kernel", "_dq_kernel", "_dkdv_kernel", "_fwd_kernel"]
