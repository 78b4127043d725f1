import json
import re
from functools import cache

import pytest

from gradtap.core.errors import ConfigError
from gradtap.netconfig.plan import PlannedSource, SwitchInfo
from gradtap.netconfig.planner import plan_topology
from gradtap.netconfig.render import render_plan
from gradtap.netconfig.topology import MirrorPolicy, load_topology
from gradtap.netconfig.vendors import VENDORS, spec
from gradtap.netconfig.vendors.base import build_sessions
from tests.netconfig import vendor_rules
from tests.netconfig.topologies import EXAMPLES

# The sonic-mirror-session YANG model (sonic-buildimage, revision 2021-06-15).
YANG_NAME = re.compile(r"[a-zA-Z0-9]{1}([-a-zA-Z0-9_]{0,31})")
YANG_SPAN_FIELDS = {"type", "dst_port", "src_port", "direction", "queue", "policer"}
YANG_ERSPAN_FIELDS = {"type", "src_ip", "dst_ip", "gre_type", "dscp", "ttl", "queue", "src_port", "direction",
                      "policer"}

# Every non-comment line a renderer may emit, per vendor.
GRAMMAR = {
    "sonic": [r"config mirror_session span add \S+ [^\s,]+ ([^\s,]+,)*[^\s,]+ (rx|tx|both)",
              r"config mirror_session erspan add \S+ [\d.]+ [\d.]+ \d+ \d+ 0x88be 0 ([^\s,]+,)*[^\s,]+ (rx|tx|both)",
              r"config mirror_session remove \S+", r"set -e",
              r"refuse_if_set\(\) \{ if \[ -n \"\$\(sonic-db-cli CONFIG_DB keys \"\$1\"\)\" \]; then "
              r"echo \"gradtap: \$2\" >&2; exit 1; fi; \}",
              r"refuse_if_set '[A-Z_]+\|[^'\s]+' '[^']+'"],
    "eos": [r"monitor session \S+ source \S+ (rx|tx|both)", r"monitor session \S+ destination \S+",
            r"monitor session \S+ destination tunnel mode gre source [\d.]+ destination [\d.]+ ttl \d+ dscp \d+",
            r"no monitor session \S+"],
    "nxos": [r"interface \S+", r"  switchport", r"  switchport monitor", r"  no switchport monitor",
             r"monitor erspan origin ip-address [\d.]+ global", r"monitor session ([1-9]|[12]\d|3[0-2]) type "
             r"(local|erspan-source)", r"  description gradtap", r"  erspan-id \d+", r"  vrf default",
             r"  destination ip [\d.]+", r"  ip ttl \d+", r"  ip dscp \d+", r"  header-type 3",
             r"  source interface \S+ (rx|tx|both)",
             r"  destination interface \S+", r"  no shut", r"no monitor session ([1-9]|[12]\d|3[0-2])"],
    "comware": [r"system-view", r"return", r"mirroring-group \d+ local",
                r"mirroring-group \d+ mirroring-port \S+ (inbound|outbound|both)",
                r"mirroring-group \d+ monitor-port \S+",
                r"mirroring-group \d+ monitor-port \S+ destination-ip [\d.]+ source-ip [\d.]+ dscp \d+",
                r"undo mirroring-group \d+"],
    "junos": [r"set groups gradtap interfaces \S+ unit 0 family ethernet-switching",
              r"set groups gradtap (forwarding-options|ethernet-switching-options) analyzer \S+ input (ingress|egress) "
              r"interface \S+\.\d+",
              r"set groups gradtap (forwarding-options|ethernet-switching-options) analyzer \S+ output interface "
              r"\S+\.\d+", r"set apply-groups gradtap", r"commit", r"delete apply-groups gradtap",
              r"delete groups gradtap"],
    "nvue": [r"nv set system port-mirror session [0-7] span source-port \S+",
             r"nv set system port-mirror session [0-7] span destination \S+",
             r"nv set system port-mirror session [0-7] span direction (ingress|egress)",
             r"nv set system port-mirror session [0-7] erspan source-port \S+",
             r"nv set system port-mirror session [0-7] erspan destination (source-ip|dest-ip) [\d.]+",
             r"nv set system port-mirror session [0-7] erspan direction (ingress|egress)",
             r"nv unset system port-mirror session [0-7]", r"nv config apply"],
    "linux": [r"tc qdisc add dev \S+ clsact", r"tc qdisc del dev \S+ clsact",
              r"tc filter add dev \S+ (ingress|egress) protocol all prio \d+ u32 match u32 0 0 action mirred "
              r"egress mirror dev \S+", r"tc filter del dev \S+ (ingress|egress) protocol all prio \d+"],
}


def source(name="m0", port="Ethernet0", direction="egress", dest="Ethernet9", encapsulation="none", ip=None):
    return PlannedSource(name=name, group="tp0-pp0", position=0, dp_rank=0, global_rank=0, node="gpu0", nic="n0",
                         direction=direction, switch="sw", port=port, speed_gbps=100, load_gbps=100,
                         cpu_node="ckpt0", cpu_nic="c0", dest_switch="sw" if encapsulation == "none" else "other",
                         dest_port=dest, encapsulation=encapsulation, erspan_dst_ip=ip)


def switch(**kw) -> SwitchInfo:
    return SwitchInfo(name="sw", vendor="sonic", ports_total=32, ports_free=8, **kw)


MIXED = [source("m0", "Ethernet0", "egress"), source("m1", "Ethernet1", "ingress"), source("m2", "Ethernet2", "both")]


def shape(vendor, sources, limits=None, **kw):
    policy = MirrorPolicy(loss_rate=1e-9, packets_per_iteration=1e6, session_limits=limits or {})
    return [(s.id, s.destination, s.direction, [(m.port, m.direction) for m in s.members])
            for s in build_sessions(spec(vendor), switch(**kw), sources, policy)]


def test_sessions_share_a_destination_and_split_by_direction_where_the_platform_must():
    assert shape("eos", MIXED) == [("gradtap-0", "Ethernet9", None,
                                    [("Ethernet0", "rx"), ("Ethernet1", "tx"), ("Ethernet2", "both")])]
    assert shape("sonic", MIXED) == [("gradtap-0", "Ethernet9", "rx", [("Ethernet0", "rx")]),
                                     ("gradtap-1", "Ethernet9", "tx", [("Ethernet1", "tx")]),
                                     ("gradtap-2", "Ethernet9", "both", [("Ethernet2", "both")])]
    assert shape("nvue", MIXED) == [(0, "Ethernet9", "rx", [("Ethernet0", "rx"), ("Ethernet2", "rx")]),
                                    (1, "Ethernet9", "tx", [("Ethernet1", "tx"), ("Ethernet2", "tx")])]


def test_session_limits_numbers_and_names():
    with pytest.raises(ConfigError, match="the plan needs 3 mirror sessions, but the switch allows 2"):
        shape("sonic", MIXED, max_mirror_sessions=2)
    with pytest.raises(ConfigError, match="allows 1 .*mirror.session_limits.sonic"):
        shape("sonic", MIXED, limits={"sonic": 1})
    assert len(shape("sonic", MIXED, limits={"sonic": 1}, max_mirror_sessions=3)) == 3  # the switch wins
    assert len(shape("nvue", MIXED, limits={"sonic": 1})) == 2
    assert [s[0] for s in shape("nxos", [source(dest=f"Ethernet{9 + i}", port=f"Ethernet{i}") for i in range(2)],
                                session_id_base=31)] == [31, 32]
    with pytest.raises(ConfigError, match=r"session number 33 is not allowed \(must be 1..32"):
        shape("nxos", [source(dest=f"Ethernet{9 + i}", port=f"Ethernet{i}") for i in range(3)], session_id_base=31)
    assert YANG_NAME.fullmatch(shape("sonic", MIXED)[2][0])


def test_erspan_needs_a_capable_platform_and_a_source_address():
    remote = [source(encapsulation="erspan2", ip="10.9.9.9")]
    with pytest.raises(ConfigError, match="needs erspan2 because CPU node ckpt0 is cabled to other, not sw; "
                                          "Juniper Junos renders no ERSPAN"):
        shape("junos", remote)
    with pytest.raises(ConfigError, match="ERSPAN needs a source address"):
        shape("sonic", remote)
    with pytest.raises(ConfigError, match="Arista EOS renders erspan2"):
        shape("eos", [source(encapsulation="erspan3", ip="10.9.9.9")], erspan_source_ip="10.0.0.1")


@cache
def example_plan(name):
    return plan_topology(load_topology(EXAMPLES / f"{name}.yaml"))


def rendered(name, vendor):
    plan = example_plan(name)
    try:
        return render_plan(plan, vendor, sorted({s.switch for g in plan.groups[:2] for s in g.sources}))
    except ConfigError:
        return []


@pytest.mark.parametrize("vendor", list(VENDORS))
@pytest.mark.parametrize("example", ["flowcheck-testbed", "erspan-two-leaf", "gpt-175b-1536gpu"])
def test_every_rendered_line_is_in_the_platform_grammar(example, vendor):
    grammar = [re.compile(g) for g in GRAMMAR[vendor]]
    for config in rendered(example, vendor):
        for name, text in [*config.apply.items(), *config.teardown.items()]:
            if name.endswith(".json"):
                continue
            for line in text.splitlines():
                if line.strip() and not line.lstrip().startswith(("#", "!")):
                    assert any(g.fullmatch(line) for g in grammar), f"{vendor} {name}: {line!r}"


@pytest.mark.parametrize("example", ["erspan-two-leaf", "gpt-175b-1536gpu", "gpt-1t-3072gpu"])
def test_sonic_config_db_follows_the_yang_model(example):
    configs = rendered(example, "sonic")
    assert configs
    for config in configs:
        sessions = json.loads(config.apply["config_db.json"])["MIRROR_SESSION"]
        patch = json.loads(config.teardown["apply-patch.json"])
        # generic_config_updater rejects a patch that empties a table: remove the table itself.
        assert patch == [{"op": "remove", "path": "/MIRROR_SESSION"}]
        for name, entry in sessions.items():
            assert YANG_NAME.fullmatch(name)
            assert entry["type"] in ("SPAN", "ERSPAN") and entry["direction"] in ("RX", "TX", "BOTH")
            assert set(entry) <= (YANG_SPAN_FIELDS if entry["type"] == "SPAN" else YANG_ERSPAN_FIELDS)
            assert all(isinstance(v, str) for v in entry.values())  # CONFIG_DB holds strings
            if entry["type"] == "ERSPAN":
                assert 0 <= int(entry["dscp"]) <= 63 and 0 <= int(entry["ttl"]) <= 255


@pytest.mark.parametrize("vendor", ["sonic", "eos", "nxos"])
def test_erspan_dscp_and_ttl_come_from_the_policy(vendor):
    """The policy's outer-header DSCP and TTL are rendered, never dropped for a platform default."""
    policy = MirrorPolicy(loss_rate=1e-9, packets_per_iteration=1e6, erspan={"dscp": 46, "ttl": 17})
    sw = switch(erspan_source_ip="10.0.0.1")
    module = VENDORS[vendor]
    config = module.render(sw, build_sessions(module.SPEC, sw, [source(encapsulation="erspan2", ip="10.9.9.9")],
                                              policy))
    result = vendor_rules.check(vendor, config.apply, config.teardown, {"Ethernet0"})
    assert not result.problems, result.problems
    if vendor == "sonic":
        entry = json.loads(config.apply["config_db.json"])["MIRROR_SESSION"]["gradtap-0"]
        assert (entry["ttl"], entry["dscp"]) == ("17", "46")
    else:
        assert result.erspan == {"erspan:10.9.9.9": (17, 46)}
