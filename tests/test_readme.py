"""The README's quickstart, run as written: under torchrun with 2 gloo ranks it prints each
rank's output shape and its error against flash_attn on the full sequence, in the format
the README shows; with 3 ranks (a world size that does not divide 4096) it runs too, at a
shorter sequence to save CPU time; without torchrun it stops with a message that says how
to start it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from dist_utils import run_command

ROOT = Path(__file__).resolve().parents[1]
SEQLEN_LINE = "seqlen = 2048 * world"
# rank, world, out's shape, max error: the line every rank prints.
# Not anchored to lines: the ranks print at once, and one rank's line may start where
# another's has not ended.
LINE = re.compile(r"rank (\d+) of (\d+): out \((\d+), (\d+), (\d+), (\d+)\), "
                  r"max error vs one device ([0-9.]+e[-+]\d+)")


def readme() -> str:
    return (ROOT / "README.md").read_text()


def readme_example() -> str:
    blocks = re.findall(r"```python\n(# example\.py.*?)```", readme(), flags=re.S)
    assert len(blocks) == 1, "README.md should hold one ```python block starting with '# example.py'"
    assert SEQLEN_LINE in blocks[0], f"the example should set the length with {SEQLEN_LINE!r}"
    return blocks[0]


def readme_expected_output() -> str:
    """The ```text block right after the example: the output the README promises."""
    match = re.search(r"```python\n# example\.py.*?```\n.*?```text\n(.*?)```", readme(), flags=re.S)
    assert match, "README.md should show the example's output in a ```text block after it"
    return match.group(1)


def _run_example(tmp_path, source: str, ranks: int) -> list[tuple]:
    (tmp_path / "example.py").write_text(source)
    rc, out = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={ranks}", "--max-restarts=0", "example.py"],
                          tmp_path, timeout=300)
    assert rc == 0, out[-4000:]
    lines = LINE.findall(out)
    assert sorted(int(line[0]) for line in lines) == list(range(ranks)), out[-4000:]
    return lines


def _check(lines, ranks: int, seqlen_local: int) -> None:
    for rank, world, *shape, err in lines:
        assert int(world) == ranks
        assert tuple(map(int, shape)) == (1, seqlen_local, 8, 64), shape
        assert float(err) < 1e-4, (rank, err)


def test_readme_example_under_torchrun(tmp_path):
    lines = _run_example(tmp_path, readme_example(), ranks=2)
    _check(lines, ranks=2, seqlen_local=2048)
    shown = LINE.findall(readme_expected_output())
    assert sorted(int(line[0]) for line in shown) == [0, 1], "the README should show both ranks' lines"
    _check(shown, ranks=2, seqlen_local=2048)


def test_readme_example_on_three_ranks(tmp_path):
    source = readme_example().replace(SEQLEN_LINE, "seqlen = 128 * world")
    _check(_run_example(tmp_path, source, ranks=3), ranks=3, seqlen_local=128)


def test_readme_example_without_torchrun_says_how_to_start_it(tmp_path):
    (tmp_path / "example.py").write_text(readme_example())
    rc, out = run_command([sys.executable, "example.py"], tmp_path, timeout=60)
    assert rc != 0 and "torchrun --nproc-per-node=2 example.py" in out, out
    assert "env://" not in out
