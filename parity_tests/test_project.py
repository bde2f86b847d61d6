"""The project's promises about itself: CI runs the README's test command, flax_attn never imports torch,
every public name is documented."""
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands():
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_exactly_the_readme_test_command():
    commands = _readme_commands()
    test_command = next(c for c in commands if "pytest parity_tests" in c)
    ci_lines = [l for l in (ROOT / ".ci" / "run").read_text().splitlines() if l and not l.startswith(("#", "set ", "cd "))]
    assert ci_lines == [test_command]


def test_flax_attn_does_not_import_torch():
    code = "import sys, flax_attn; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


@pytest.mark.slow
def test_readme_usage_snippet_runs():
    import torch
    import torch_ref

    snippet = re.search(r"```python\n(.+?)\n```", (ROOT / "README.md").read_text(), re.S).group(1)
    twin = torch_ref.MultiHeadAttention(768, 768, 1024, 0.1, 12)
    namespace = {"state_dict": torch_ref.state_dict_to_numpy(twin.state_dict())}
    exec(compile(snippet, "README.md", "exec"), namespace)
    assert namespace["y"].shape == (4, 1, 512)
    assert set(namespace["state_dict"]) == set(twin.state_dict())
    twin.load_state_dict(torch_ref.state_dict_from_numpy(namespace["state_dict"]), strict=True)
    assert torch.equal(twin.out_proj.bias, torch.from_numpy(namespace["state_dict"]["out_proj.bias"]))


def test_every_public_name_is_documented():
    import flax_attn as fa

    for name in fa.__all__:
        obj = getattr(fa, name)
        assert (obj.__doc__ or "").strip(), f"flax_attn.{name} has no docstring"
