"""A topology or plan file that is no such file (binary, gzip, zeros, nested past any parser's
depth) is named with what is wrong and what the file should be, never a traceback (issue 11)."""

from __future__ import annotations

import pytest

from gradtap.core.errors import ConfigError
from gradtap.netconfig.plan import load_plan
from gradtap.netconfig.topology import load_topology
from tests.netconfig.test_cli import gradtap_process

TOPOLOGY_IS = r"a topology is a YAML file such as those in configs/topologies/"
PLAN_IS = r"a plan is the plan\.json `gradtap netconfig plan` writes"

CASES = [
    pytest.param(load_topology, "cluster.yaml", b"name: x\n\xff\xfe\x00\x01",
                 r"\(top level\): not a text file \(byte 0xff at offset 8 is not UTF-8\); " + TOPOLOGY_IS,
                 id="topology-binary"),
    pytest.param(load_topology, "cluster.yaml", b"\x1f\x8b\x08\x00" + bytes(range(256)),
                 r"\(top level\): not a text file \(byte 0x8b at offset 1 is not UTF-8\)", id="topology-gzip"),
    pytest.param(load_topology, "cluster.yaml", bytes(4096),
                 r"cannot read topology: unacceptable character #x0000", id="topology-zeros"),
    pytest.param(load_topology, "cluster.yaml", b"[" * 100_000,
                 r"\(top level\): nested too deeply for a topology", id="topology-deep"),
    pytest.param(load_plan, "plan.json", b'{"format": "\xc3\x28"}',
                 r"\(top level\): not a text file \(byte 0xc3 at offset 12 is not UTF-8\); " + PLAN_IS,
                 id="plan-binary"),
    pytest.param(load_plan, "plan.json", bytes(4096), r"cannot read plan: Expecting value: line 1 column 1 "
                 r"\(char 0\); " + PLAN_IS, id="plan-zeros"),
    pytest.param(load_plan, "plan.json", b"[" * 100_000, r"\(top level\): nested too deeply for a plan",
                 id="plan-deep"),
]


@pytest.mark.parametrize("load, name, content, message", CASES)
def test_a_file_that_is_not_one_is_named(tmp_path, load, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=rf"^{name}: {message}"):
        load(path)


def test_an_unreadable_file_is_named(tmp_path):
    (tmp_path / "cluster.yaml").mkdir()
    with pytest.raises(ConfigError, match=r"^cluster\.yaml: cannot read topology: Is a directory \("):
        load_topology(tmp_path / "cluster.yaml")


@pytest.mark.parametrize("command, name", [("plan", "cluster.yaml"), ("render", "plan.json")])
def test_the_command_line_says_so_without_a_traceback(tmp_path, command, name):
    path = tmp_path / name
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    done = gradtap_process("netconfig", command, str(path))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"error: {name}: (top level): not a text file (byte 0x89 at offset 0 "), done.stderr
