"""The SONiC renderings checked against SONiC's own YANG model, read from its file.

The model is not part of this repository: point ``GRADTAP_SONIC_YANG_MODELS`` at the
``src/sonic-yang-models`` directory of a sonic-buildimage checkout (its ``yang-models/`` and
``tests/yang_model_tests/`` are used). Without it these tests skip; the hand-written rules of
``vendor_rules.py`` still run everywhere.

First the checker must agree with SONiC's own model tests (``tests_config/mirror_session.json``
with the expected errors in ``tests/mirror_session.json``); then every ``config_db.json`` gradtap
renders for SONiC must pass the model, its ``dst_port`` leafrefs resolved against the switch's
ports, and the hand-written rules must name the same leaves as the model.
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

import pytest

from gradtap.core.errors import ConfigError
from gradtap.netconfig.planner import plan_topology
from gradtap.netconfig.render import render_plan
from gradtap.netconfig.topology import parse_topology
from tests.netconfig import vendor_rules
from tests.netconfig.test_lag import lag_doc
from tests.netconfig.test_vendor_rules import SHIPPED, SYNTHETIC, plan, topology
from tests.netconfig.yang_model import Model, parse

MODELS = os.environ.get("GRADTAP_SONIC_YANG_MODELS")
pytestmark = pytest.mark.skipif(not MODELS, reason="set GRADTAP_SONIC_YANG_MODELS to sonic-buildimage's "
                                                   "src/sonic-yang-models to check against SONiC's YANG model")
LIST = ("sonic-mirror-session", "MIRROR_SESSION", "MIRROR_SESSION_LIST")
PORT_PATH = "/port:sonic-port/port:PORT/port:PORT_LIST/port:name"
POLICER_PATH = "/policer:sonic-policer/policer:POLICER/policer:POLICER_LIST/policer:name"


@cache
def model() -> Model:
    return Model(parse((Path(str(MODELS)) / "yang-models" / "sonic-mirror-session.yang").read_text()), LIST)


def sonic_cases() -> list[tuple[str, dict, dict]]:
    if not MODELS:
        return []
    tests = Path(MODELS) / "tests" / "yang_model_tests"
    configs = json.loads((tests / "tests_config" / "mirror_session.json").read_text())
    expected = json.loads((tests / "tests" / "mirror_session.json").read_text())
    return [(name, configs[name], expected[name]) for name in expected]


def names(config: dict, module: str, table: str) -> set[str]:
    """Keys of ``table``'s list in a SONiC YANG test document (containers are module-prefixed)."""
    container = config.get(f"{module}:{module}", {})
    rows = (container.get(f"{module}:{table}") or container.get(table) or {}).get(f"{table}_LIST", [])
    return {row["name"] for row in rows}


@pytest.mark.parametrize("name,config,expected", sonic_cases(), ids=[c[0] for c in sonic_cases()])
def test_the_checker_agrees_with_sonics_own_model_tests(name, config, expected):
    leafrefs = {PORT_PATH: names(config, "sonic-port", "PORT"),
                POLICER_PATH: names(config, "sonic-policer", "POLICER")}
    entries = config["sonic-mirror-session:sonic-mirror-session"]["MIRROR_SESSION"]["MIRROR_SESSION_LIST"]
    problems = [p for entry in entries for p in model().check(entry, leafrefs)]
    if "eStrKey" in expected:
        # libyang reports a uint8 outside a restricted range as a bound error too
        kinds = {"Bounds", "Range"} if expected["eStrKey"] == "Bounds" else {expected["eStrKey"]}
        assert any(kind in kinds for kind, _ in problems), problems
    elif "eStr" in expected:
        assert any(message == expected["eStr"] for _, message in problems), problems
    else:
        assert problems == []


def rendered_entries(p, ports: dict[str, set[str]]) -> list[tuple[str, dict, set[str]]]:
    try:
        configs = render_plan(p, "sonic", [sw.name for sw in p.switches if p.sources_on(sw.name)])
    except ConfigError as exc:  # too many sessions for SONiC's default limit (a golden ERROR file)
        pytest.skip(f"SONiC cannot render this plan: {exc}")
    out = []
    for config in configs:
        table = json.loads(config.apply["config_db.json"])["MIRROR_SESSION"]
        out += [(config.switch, {"name": key, **entry}, ports[config.switch]) for key, entry in table.items()]
    return out


@pytest.mark.parametrize("name", SHIPPED + list(SYNTHETIC) + ["lag"])
def test_every_sonic_rendering_passes_the_model(name):
    topo = parse_topology(lag_doc()) if name == "lag" else topology(name)
    ports = {sw.name: {p.name for p in sw.ports} for sw in topo.leaf_switches}
    entries = rendered_entries(plan_topology(topo) if name == "lag" else plan(name), ports)
    assert entries
    for switch, entry, known in entries:
        problems = model().check(entry, {PORT_PATH: known, POLICER_PATH: set()})
        assert problems == [], f"{name} {switch} {entry['name']}: {problems}"


def test_the_hand_written_rules_name_the_models_leaves():
    m = model()
    when_erspan = {n for n, leaf in m.leaves.items() if leaf.find("when") is not None
                   and "'ERSPAN'" in leaf.find("when").arg}
    # Leaves the model has and gradtap never writes (newer revisions add some) may be missing by hand.
    assert vendor_rules.YANG_LEAVES <= set(m.leaves)
    assert vendor_rules.YANG_ERSPAN_ONLY <= when_erspan
    assert m.leaves["name"].find("type").find("pattern").arg == vendor_rules.YANG_NAME.pattern
    assert m.leaves["gre_type"].find("type").find("pattern").arg == vendor_rules.YANG_GRE_TYPE.pattern
