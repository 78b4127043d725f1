"""The command line itself: start-up that imports no stage, help texts, 80-column output,
and the refusals of ``simulate``."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from gradtap.cli import _register, app
from gradtap.commands import COMMAND_MODULES
from tests.forked import run_cli
from tests.golden import CAPTURES
from tests.simulator.test_simulate import make_job

ROOT = Path(__file__).resolve().parents[2]
# Nothing of these may be imported before a command runs: the stages' engines, and what a
# command prints with (Rich) or validates with (pydantic). Typer, which imported both at start-up
# (half a second of ``--help`` on 2 cores, issue 9), must not come back.
HEAVY = ("torch", "numba", "numpy", "matplotlib", "pyroute2", "prometheus_client", "rich", "pydantic",
         "pydantic_core", "typer")
STAGES = ("capture", "parser", "merger", "updater", "simulator", "workload", "netconfig", "wire")
NETCONFIG = ("plan", "render", "apply", "teardown")
HELPS = [["--help"], *([c, "--help"] for c in COMMAND_MODULES), *(["netconfig", c, "--help"] for c in NETCONFIG)]


def gradtap_process(*args: str, columns: int = 80) -> subprocess.CompletedProcess:
    return run_cli(*args, cwd=ROOT, env={"COLUMNS": str(columns)}, timeout=600)


def assert_fits(text: str, width: int = 80) -> None:
    """No line wider than ``width`` and nothing cut off with an ellipsis."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)        # colours, where the environment forces them
    for line in text.splitlines():
        assert len(line) <= width, f"{len(line)} columns: {line!r}"
    assert "…" not in text, text


def test_building_the_cli_and_its_help_imports_no_stage():
    """What ``main()`` does before a command runs, then every help text and argument
    errors: none of it may import PyTorch, Numba, Rich, pydantic or a stage (that is what
    made ``--help`` take seconds, then half a second)."""
    code = f"""
import json, sys
from click.testing import CliRunner
from gradtap.cli import _register, app, main
_register()
runner = CliRunner()
for args in {HELPS!r}:
    done = runner.invoke(app, args)
    assert done.exit_code == 0, (args, done.output)
assert runner.invoke(app, ["simulate"]).exit_code == 2          # a missing argument
assert runner.invoke(app, ["replay", "--bogus"]).exit_code == 2  # an unknown option
assert runner.invoke(app, ["demo", "-n", "1"]).exit_code == 2    # a value out of range
sys.argv = ["gradtap", "run", "--help"]
try:
    main()
except SystemExit as exc:
    assert exc.code == 0, exc.code
print(json.dumps(sorted(sys.modules)))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    modules = json.loads(done.stdout.splitlines()[-1])
    assert not [m for m in modules if m.split(".")[0] in HEAVY]
    assert not [m for m in modules if m.startswith("gradtap.") and m.split(".")[1] in STAGES]


def imported_by(*command: str) -> tuple[set[str], subprocess.CompletedProcess]:
    """The modules ``command`` imports, from the interpreter's own ``-X importtime`` report
    (``PYTHONPROFILEIMPORTTIME``, which reaches a console script too), and its result."""
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1", "COLUMNS": "80"})
    modules = set(re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)$", done.stderr, re.M))
    assert modules, done.stderr
    return modules, done


def test_the_console_script_starts_on_the_standard_library_and_click_alone():
    """``gradtap replay --help`` and ``gradtap replay --bogus`` through the installed console
    script: past what the interpreter imports for any script (site, the editable-install
    finder), every module is the standard library's, Click's or the CLI's own. Judging the
    modules imported rather than the time taken keeps a slow or busy machine from failing
    this, and a heavy import (Rich, pydantic, Typer, NumPy, a stage) from passing it."""
    script = Path(sys.executable).with_name("gradtap")
    assert script.exists(), f"no console script {script}: install the project (bin/_env.sh does)"
    interpreter, _ = imported_by(sys.executable, "-c", "pass")
    shell = {"gradtap", "gradtap.cli", "gradtap.commands", "gradtap.core", "gradtap.core.errors"}
    for args, status, stream, says in ((["--help"], 0, "stdout", "Positional arguments:"),
                                      (["--bogus"], 2, "stderr", "No such option '--bogus'")):
        modules, done = imported_by(str(script), "replay", *args)
        assert done.returncode == status and says in getattr(done, stream), (args, done.stdout)
        extra = modules - interpreter
        assert "click" in extra and "gradtap.cli" in extra
        foreign = sorted(m for m in extra if m.split(".")[0] not in (*sys.stdlib_module_names, "click")
                         and not (m.startswith("gradtap.commands.") or m in shell))
        assert not foreign, (args, foreign)


def helps(columns: int = 80) -> dict[str, str]:
    _register()
    out = {}
    for args in HELPS:
        done = CliRunner().invoke(app, args, env={"COLUMNS": str(columns)})
        assert done.exit_code == 0, (args, done.output)
        out[" ".join(args[:-1])] = done.stdout
    return out


def test_help_lists_the_commands_in_the_order_of_the_data_flow():
    text = helps()[""]
    order = ("demo", "simulate", "inspect", "discover", "replay", "verify", "run", "resync", "export", "restore",
             "netconfig")
    assert COMMAND_MODULES == order
    listed = re.findall(r"^\W+(\w+)\s{2,}\w", text[text.index("Commands"):], re.M)
    assert tuple(listed) == order, text


def commands() -> list[tuple[str, object]]:
    """(``netconfig plan``, its click command) for every command and group."""
    _register()
    found = list(app.commands.items())
    found += [(f"netconfig {n}", c) for n, c in app.commands["netconfig"].commands.items()]
    return found


def test_help_texts_fit_80_columns_and_flags_show_no_value_type():
    texts = helps(80)
    for command, text in texts.items():
        assert_fits(text)
        assert "<bool>" not in text, (command, text)
    flags = 0
    for name, command in commands():
        for param in getattr(command, "params", ()):
            if getattr(param, "is_flag", False):    # the flag's spelling, then at once its help
                spelled = " / ".join(", ".join(o) for o in (param.opts, param.secondary_opts) if o)
                assert re.search(rf"^  {re.escape(spelled)}  +{re.escape(param.help.split()[0])}", texts[name],
                                 re.M), (name, spelled, texts[name])
                flags += 1
    assert flags == 15      # --keep, --force (five times), --json (twice), --digests/--no-digests, --no-status,
    #                         --linux (twice), --start-from-store (twice), --no-rehearsal


def test_every_argument_and_option_is_explained():
    for name, command in commands():
        if not hasattr(command, "commands"):
            for param in command.params:
                assert param.help, f"gradtap {name}: {param.name} has no help text"


def test_shown_choices_are_the_registries():
    from gradtap.capture.registry import SOURCES
    from gradtap.commands.netconfig import VENDOR_NAMES
    from gradtap.commands.run import SOURCE_NAMES
    from gradtap.netconfig.vendors import VENDORS

    assert SOURCE_NAMES == tuple(SOURCES)
    assert VENDOR_NAMES == tuple(VENDORS)


def test_inspect_table_fits_80_columns():
    from gradtap.commands.inspect import flows_table
    from gradtap.parser.inspect import inspect_capture

    out = io.StringIO()
    Console(file=out, width=80).print(flows_table(inspect_capture(CAPTURES / "allreduce+p2p.pcapng")))
    assert_fits(out.getvalue())
    assert "RDMA_WRITE" not in out.getvalue() and "WRITE_ONLY_IMM" in out.getvalue()


def test_netconfig_plan_report_fits_80_columns():
    from gradtap.commands.netconfig import print_plan_report
    from gradtap.configs import shipped
    from gradtap.netconfig.planner import plan_topology
    from gradtap.netconfig.report import report_dict
    from gradtap.netconfig.topology import load_topology

    for name in ("flowcheck-testbed.yaml", "erspan-two-leaf.yaml"):
        out = io.StringIO()
        print_plan_report(report_dict(plan_topology(load_topology(shipped(f"topologies/{name}")))),
                          Console(file=out, width=80))
        assert_fits(out.getvalue())
        assert "Eq. 2" in out.getvalue()


@pytest.mark.slow
def test_simulate_refuses_a_non_empty_out_and_force_clears_it(tmp_path):
    """Also: simulate's summary and inspect's tables (with --job), at 80 columns, on IPv6."""
    from gradtap.workload.spec import dump_job

    (tmp_path / "job.yaml").write_text(dump_job(make_job(2, "LL", 1, "fp32", ipv6=True)))
    out = tmp_path / "out"
    out.mkdir()
    (out / "from-an-older-run").write_text("")
    refused = gradtap_process("simulate", str(tmp_path / "job.yaml"), "--out", str(out), "-n", "1")
    assert refused.returncode == 2 and refused.stdout == ""
    assert f"--out {out} is not empty; pass --force" in " ".join(refused.stderr.split())
    assert (out / "from-an-older-run").exists()

    done = gradtap_process("simulate", str(tmp_path / "job.yaml"), "--out", str(out), "-n", "1", "--force")
    assert done.returncode == 0, done.stderr
    assert not (out / "from-an-older-run").exists() and (out / "streams" / "m-egress.pcap").exists()
    assert_fits(done.stdout)
    assert "streams/m-egress.pcap" in done.stdout

    inspected = gradtap_process("inspect", str(out / "streams" / "m-egress.pcap"), "--job", str(out / "job.yaml"))
    assert inspected.returncode == 0, inspected.stderr
    assert_fits(inspected.stdout)
    assert "messages of job" in inspected.stdout and "reduce-scatter" in inspected.stdout


@pytest.mark.slow
def test_the_demo_removes_its_directory_unless_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    _register()
    done = CliRunner().invoke(app, ["demo", "-n", "2"], env={"COLUMNS": "100"})
    assert done.exit_code == 0, done.output
    assert "bit-identical" in done.stdout and "--keep" in done.stdout
    assert not list(tmp_path.glob("gradtap-demo-*"))
