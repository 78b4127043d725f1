"""Golden files: each vendor's rendering of each example topology's plan.

Regenerate (and review the diff!) with ``GRADTAP_REGEN_GOLDEN=1 .venv/bin/python -m pytest
tests/netconfig/test_render.py``. The Table 2 examples have 48-96 leaves; their goldens hold
the switches of the first and last DP group, and a summary of the whole plan.
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

import pytest

from gradtap.core.errors import ConfigError
from gradtap.netconfig.job_specs import spec_files
from gradtap.netconfig.plan import Plan, SwitchInfo, load_plan, save_plan
from gradtap.netconfig.planner import plan_topology
from gradtap.netconfig.render import format_configs, render_plan, write_configs
from gradtap.netconfig.report import report_dict
from gradtap.netconfig.topology import MirrorPolicy, load_topology
from gradtap.netconfig.vendors import VENDORS, junos
from gradtap.netconfig.vendors.base import build_sessions
from tests.netconfig.test_vendors import source
from tests.netconfig.topologies import EXAMPLES

GOLDEN = Path(__file__).parent / "golden"
REGENERATE = os.environ.get("GRADTAP_REGEN_GOLDEN") == "1"
SMALL = ["flowcheck-testbed", "erspan-two-leaf", "mirror-group-two-nodes"]
LARGE = ["gpt-175b-1536gpu", "mt-nlg-530b-2240gpu", "gpt-1t-3072gpu"]


@cache
def example_plan(name: str) -> Plan:
    return plan_topology(load_topology(EXAMPLES / f"{name}.yaml"))


def golden_switches(name: str) -> list[str] | None:
    if name in SMALL:
        return None
    plan = example_plan(name)
    ends = {s.switch for g in (plan.groups[0], plan.groups[-1]) for s in g.sources}
    return [sw.name for sw in plan.switches if sw.name in ends]


def rounded(value):
    """Floats to 6 significant digits, so goldens do not depend on the last bits of libm."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def check_golden(path: Path, text: str) -> None:
    if REGENERATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} is missing; create it with GRADTAP_REGEN_GOLDEN=1 and review it"
    assert text == path.read_text(), f"{path} differs; if the change is intended, regenerate and review the diff"


@pytest.mark.parametrize("vendor", list(VENDORS))
@pytest.mark.parametrize("example", SMALL + LARGE)
def test_vendor_output_matches_golden(example, vendor):
    try:
        text = format_configs(render_plan(example_plan(example), vendor, golden_switches(example)))
    except ConfigError as exc:
        text = f"ERROR: {exc}\n"
    check_golden(GOLDEN / example / f"{vendor}.txt", text)


@pytest.mark.parametrize("example", SMALL + LARGE)
def test_plan_summary_matches_golden(example):
    plan = example_plan(example)
    report = report_dict(plan)
    if example in LARGE:
        report["groups"] = [report["groups"][0], report["groups"][-1]]
        report["cpu_nodes"] = len(report["cpu_nodes"])
        report["switches"] = {"count": len(report["switches"]),
                              "max_sessions": max(s["sessions"] for s in report["switches"])}
    ends = {g.id: g for g in (plan.groups[0], plan.groups[-1])}
    mirrors = "".join(f.text() for f in spec_files(plan) if f.group.id in ends)
    text = json.dumps(rounded(report), indent=2, allow_nan=False) + "\n"
    check_golden(GOLDEN / example / "report.json", text)
    check_golden(GOLDEN / example / "mirrors.yaml", mirrors)


def test_plan_round_trips_through_json(tmp_path):
    plan = example_plan("erspan-two-leaf")
    save_plan(plan, tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json") == plan


def test_a_damaged_plan_is_rejected_with_the_field_path(tmp_path):
    data = json.loads(example_plan("flowcheck-testbed").model_dump_json())
    data["groups"][0]["sources"][1]["direction"] = "sideways"
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"plan.json: groups\[0\].sources\[1\].direction: 'sideways' is not "
                                          r"allowed \(must be one of 'egress', 'ingress' or 'both'\)"):
        load_plan(tmp_path / "plan.json")


def test_configs_are_written_one_file_per_switch_and_kind(tmp_path):
    paths = write_configs(render_plan(example_plan("erspan-two-leaf"), "sonic"), tmp_path)
    assert sorted(p.name for p in paths) == sorted(
        f"{sw}.{kind}sonic.{suffix}" for sw in ("leaf-a", "leaf-b")
        for kind, suffix in (("", "config_db.json"), ("", "commands.sh"), ("teardown.", "apply-patch.json"),
                             ("teardown.", "commands.sh")))


def test_unknown_vendor_and_switch():
    with pytest.raises(ConfigError, match="vendor 'ios' is not supported"):
        render_plan(example_plan("flowcheck-testbed"), "ios")
    with pytest.raises(ConfigError, match="switch 'leaf9' is not part of this plan"):
        render_plan(example_plan("flowcheck-testbed"), None, ["leaf9"])


def test_junos_non_els_matches_golden():
    """No shipped topology has a non-ELS EX switch; this golden holds one analyzer on one."""
    switch = SwitchInfo(name="ex4200", vendor="junos", ports_total=48, ports_free=8, junos_els=False)
    sources = [source(name="m0", port="ge-0/0/0", dest="ge-0/0/47"),
               source(name="m1", port="ge-0/0/1", dest="ge-0/0/47", direction="both")]
    policy = MirrorPolicy(loss_rate=1e-9, packets_per_iteration=1e6)
    config = junos.render(switch, build_sessions(junos.SPEC, switch, sources, policy))
    check_golden(GOLDEN / "junos-non-els" / "junos.txt", format_configs([config]))
