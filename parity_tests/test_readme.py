"""Every Python code block of README.md runs, in order, in one namespace (as a reader would paste
them into one session), in a scratch directory. A block that stops working fails here, so the
README cannot rot."""
import os
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks():
    text = README.read_text(encoding="utf-8")
    return [(text[: m.start()].count("\n") + 2, m.group(1)) for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


def test_the_readme_has_python_blocks():
    assert len(python_blocks()) >= 3


@pytest.mark.slow
def test_every_python_block_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "readme"}
    for line, code in python_blocks():
        try:
            exec(compile(code, f"README.md:{line}", "exec"), namespace)
        except Exception as e:  # name the block that broke
            pytest.fail(f"the README's code block at line {line} raised {type(e).__name__}: {e}")
    assert os.path.isdir(tmp_path / "ckpt")  # the checkpoint block wrote where it was run
