"""The README's "Write your own pass" examples run as written."""
from __future__ import annotations

import re

import pytest

from conftest import ROOT, TINY, vgraph_in_process


def readme_block(marker: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    (block,) = [b for b in blocks if marker in b]
    return block


@pytest.mark.parametrize("marker,spec,expect", [
    ("class ScaleDropout", "scale-dropout{factor=0.1}", "rescaled=4"),
    ("class DropSlightDropout", "drop-slight-dropout{max_rate=0.2}", "dropped=4"),
])
def test_readme_pass_examples_run(tmp_path, marker, spec, expect, local_passes):
    plugin = tmp_path / "my_passes.py"
    plugin.write_text(readme_block(marker))
    out = tmp_path / "out.yml"
    done = vgraph_in_process("optimize", TINY, "--plugin", plugin, "--passes", spec, "-o", out, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert expect in done.stdout and out.exists()
