"""The README's two-process example, as written but for a shorter sequence (1024 tokens
instead of 4096, to save CPU time): under torchrun (2 gloo ranks) it prints each rank's
error against flash_attn on the full sequence; without torchrun it stops with a message
that says how to start it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from dist_utils import run_command

ROOT = Path(__file__).resolve().parents[1]


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(# example\.py\n.*?)```", text, flags=re.S)
    assert len(blocks) == 1, "README.md should hold one ```python block starting with '# example.py'"
    assert "torch.randn(1, 4096, 8, 64" in blocks[0]
    return blocks[0].replace("torch.randn(1, 4096, 8, 64", "torch.randn(1, 1024, 8, 64")


def _run(cmd, cwd, timeout=120):
    return run_command(cmd, cwd, timeout)


def test_readme_example_under_torchrun(tmp_path):
    (tmp_path / "example.py").write_text(readme_example())
    rc, out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    "--max-restarts=0", "example.py"], tmp_path)
    assert rc == 0, out[-4000:]
    errors = dict(re.findall(r"^([01]) (\S+)$", out, flags=re.M))
    assert sorted(errors) == ["0", "1"], out[-4000:]
    assert all(float(e) < 1e-4 for e in errors.values()), errors


def test_readme_example_without_torchrun_says_how_to_start_it(tmp_path):
    (tmp_path / "example.py").write_text(readme_example())
    rc, out = _run([sys.executable, "example.py"], tmp_path, timeout=60)
    assert rc != 0 and "torchrun --nproc-per-node=2 example.py" in out, out
    assert "env://" not in out
