"""The project's promises about itself: CI runs the README's test command, flax_attn never imports torch,
every public name is documented."""
import pathlib
import re
import subprocess
import sys

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


def test_every_public_name_is_documented():
    import flax_attn as fa

    for name in fa.__all__:
        obj = getattr(fa, name)
        assert (obj.__doc__ or "").strip(), f"flax_attn.{name} has no docstring"
