"""``gradtap netconfig`` end to end: in-process through the Click app, and once through the real
entry point (a subprocess) to see errors become exit status 2 and a message."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from gradtap.cli import _register, app

from tests.netconfig.test_linux_mirror import Lab
from tests.netconfig.topologies import EXAMPLES

ROOT = Path(__file__).resolve().parents[2]


def gradtap_process(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from gradtap.cli import main; main()", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})


def gradtap(*args: str):
    _register()
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def test_plan_writes_plan_report_and_job_spec_sections(tmp_path):
    done = gradtap("netconfig", "plan", str(EXAMPLES / "flowcheck-testbed.yaml"), "--out", str(tmp_path))
    assert done.exit_code == 0
    assert "P(any group fails per iteration) = 6e-12 exact, 6e-12 Eq. 2" in done.stdout
    assert "Cost, USD/day (8 GPUs, 1 servers)" in done.stdout
    assert "gpu_server_usd_per_hour" in done.stdout and "FlowCheck default" in done.stdout
    assert json.loads((tmp_path / "report.json").read_text())["job"]["dp_groups"] == 1
    section = yaml.safe_load((tmp_path / "mirrors" / "tp0-pp0.yaml").read_text())
    assert [m["rank"] for m in section["mirrors"]] == [0, 1, 2]

    json_out = gradtap("netconfig", "plan", str(EXAMPLES / "flowcheck-testbed.yaml"), "--json")
    # No cost: section: FlowCheck's inputs, labelled as such. 1 CPU node x 1.37 $/h x 24 h.
    cost = json.loads(json_out.stdout)["cost"]
    assert cost["plan"]["gradtap_usd_per_day"]["cpu_nodes"] == pytest.approx(32.88)
    assert set(cost["sources"].values()) == {"FlowCheck default"}

    rendered = gradtap("netconfig", "render", str(tmp_path / "plan.json"), "--vendor", "comware")
    assert rendered.exit_code == 0
    assert rendered.stdout == (ROOT / "tests/netconfig/golden/flowcheck-testbed/comware.txt").read_text()


def test_errors_exit_2_with_the_message(tmp_path):
    bad = tmp_path / "topology.yaml"
    bad.write_text("name: x\nlayout: {dp: 2}\nmirror: {loss_rate: -1, packets_per_iteration: 10}\n")
    done = gradtap_process("netconfig", "plan", str(bad))
    assert done.returncode == 2
    assert "topology.yaml: mirror.loss_rate: -1 is not allowed (must be >= 0)" in " ".join(done.stderr.split())

    gradtap("netconfig", "plan", str(EXAMPLES / "flowcheck-testbed.yaml"), "--out", str(tmp_path))
    refused = gradtap_process("netconfig", "apply", str(tmp_path / "plan.json"))
    assert refused.returncode == 2 and "pass --linux" in refused.stderr


@pytest.mark.privileged
@pytest.mark.timeout(20)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")
def test_apply_and_teardown_from_the_command_line(tmp_path):
    lab = Lab()
    try:
        lab.build()
        topology = tmp_path / "lab.yaml"
        topology.write_text(yaml.safe_dump(lab.topology(["egress"])))
        assert gradtap("netconfig", "plan", str(topology), "--out", str(tmp_path)).exit_code == 0
        plan = str(tmp_path / "plan.json")
        untouched = lab.tc_state()
        state = str(tmp_path / "state" / "sw0.json")
        first = gradtap("netconfig", "apply", plan, "--linux", "--netns", lab.sw, "--state", state)
        assert first.exit_code == 0
        assert first.stdout.count("created") == 3
        again = gradtap("netconfig", "apply", plan, "--linux", "--netns", lab.sw, "--state", state)
        assert again.stdout.count("already in place") == 3
        down = gradtap("netconfig", "teardown", "--linux", "--state", state)
        assert down.exit_code == 0 and down.stdout.count("removed") >= 3
        assert lab.tc_state() == untouched
        assert not (tmp_path / "state" / "sw0.json").exists()
    finally:
        lab.destroy()
