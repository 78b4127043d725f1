"""Every benchmark answers ``--help`` with its usage and runs nothing: ``benchmarks.simulate``
and ``benchmarks.plan`` once took their first argument for a job file (``--help: cannot read
the job spec``), and ``benchmarks.icrc`` ignored its arguments and ran the whole benchmark."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(p.stem for p in (ROOT / "benchmarks").glob("[a-z]*.py"))

# One process for them all (their imports, torch among them, are paid once): each module run
# as ``python -m benchmarks.NAME --help`` would be, its exit code and the usage's first line.
ASK = """
import contextlib, io, runpy, sys
for name in sys.argv[1:]:
    sys.argv = [name, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_module(f"benchmarks.{name}", run_name="__main__")
        code = "ran"
    except SystemExit as exc:
        code = exc.code
    except Exception as exc:
        code = type(exc).__name__
    print(name, code, out.getvalue().splitlines()[0] if out.getvalue() else "")
"""


def test_every_benchmark_answers_help_without_running():
    assert len(MODULES) >= 10
    out = subprocess.run([sys.executable, "-c", ASK, *MODULES], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    answers = {}
    for line in out.stdout.splitlines():
        name, code, *usage = line.split(maxsplit=2)
        answers[name] = code, "".join(usage)
    assert sorted(answers) == MODULES
    for name, (code, usage) in answers.items():
        assert code in ("0", "None") and usage.startswith("usage:"), (name, code, usage)
