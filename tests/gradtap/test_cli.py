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
import typer
from rich.console import Console
from typer.testing import CliRunner

from gradtap.cli import _register, app
from gradtap.commands import COMMAND_MODULES
from tests.golden import CAPTURES
from tests.simulator.test_simulate import make_job

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "numba", "numpy", "matplotlib", "pyroute2", "prometheus_client")
STAGES = ("capture", "parser", "merger", "updater", "simulator", "workload", "netconfig", "wire")
NETCONFIG = ("plan", "render", "apply", "teardown")
HELPS = [["--help"], *([c, "--help"] for c in COMMAND_MODULES), *(["netconfig", c, "--help"] for c in NETCONFIG)]


def gradtap_process(*args: str, columns: int = 80) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from gradtap.cli import main; main()", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": str(columns)})


def assert_fits(text: str, width: int = 80) -> None:
    """No line wider than ``width`` and nothing cut off with an ellipsis."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)        # colours, where the environment forces them
    for line in text.splitlines():
        assert len(line) <= width, f"{len(line)} columns: {line!r}"
    assert "…" not in text, text


def test_building_the_cli_and_its_help_imports_no_stage():
    """What ``main()`` does before a command runs, then every help text and an argument
    error: none of it may import PyTorch, Numba or a stage (that is what made ``--help``
    take seconds)."""
    code = f"""
import json, sys
from typer.testing import CliRunner
from gradtap.cli import _register, app, main
_register()
runner = CliRunner()
for args in {HELPS!r}:
    done = runner.invoke(app, args)
    assert done.exit_code == 0, (args, done.output)
assert runner.invoke(app, ["simulate"]).exit_code == 2          # a missing argument
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
    order = ("demo", "simulate", "inspect", "replay", "verify", "run", "resync", "netconfig")
    assert COMMAND_MODULES == order
    listed = re.findall(r"^\W+(\w+)\s{2,}\w", text[text.index("Commands"):], re.M)
    assert tuple(listed) == order, text


def test_help_texts_fit_80_columns_and_flags_show_no_value_type():
    for command, text in helps(80).items():
        assert_fits(text)
        assert "<bool>" not in text, (command, text)


def test_every_argument_and_option_is_explained():
    _register()
    group = typer.main.get_command(app)
    commands = [(name, group.commands[name]) for name in group.commands]
    commands += [(f"netconfig {n}", c) for n, c in group.commands["netconfig"].commands.items()]
    for name, command in commands:
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
