"""A DP group's streams over several CPU nodes (a mirror group): when the planner spreads them,
how, what it reports, and the per-node job specs it writes.

The properties are checked from the plan's sources alone (each stream placed once, every node's
ingest within its limit, ranks, rendezvous), not from the planner's own summaries, and what a
node lacks is recomputed with the literal replay of NCCL's ring in ``naive_ring``."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from functools import cache
from pathlib import Path, PurePosixPath

import pytest
import yaml
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gradtap.commands.netconfig import write_plan_dir
from gradtap.configs import shipped
from gradtap.core.errors import ConfigError
from gradtap.netconfig.job_specs import Rendezvous, spec_files
from gradtap.netconfig.plan import Plan, load_plan, save_plan
from gradtap.netconfig.planner import plan_topology
from gradtap.netconfig.report import report_dict
from gradtap.netconfig.topology import Topology, load_topology, parse_topology
from gradtap.workload.spec import load_job, parse_job
from tests.netconfig.naive_ring import allgather_chunks_sent
from tests.netconfig.test_planner import infeasible, plan_of
from tests.netconfig.topologies import EXAMPLES, edited, one_leaf

SHIPPED = sorted(p.stem for p in EXAMPLES.glob("*.yaml"))


@cache
def shipped_plan(name: str) -> Plan:
    return plan_topology(load_topology(EXAMPLES / f"{name}.yaml"))


def two_nodes(dp: int = 8, ingest: float = 200, ports: int = 3, nodes: int = 2, cpu_speed: float = 100,
              **mirror) -> dict:
    """``one_leaf`` (100G ranks) with ``nodes`` CPU nodes of ``ports`` ports each, each taking in at
    most ``ingest`` Gbps."""
    doc = one_leaf(dp=dp, cpu_ports=ports * nodes, cpu_speed=cpu_speed)
    ports_of = doc["cpu_nodes"][0]["ports"]
    doc["cpu_nodes"] = [{"name": f"ckpt{chr(ord('a') + n)}", "max_ingest_gbps": ingest,
                         "ports": ports_of[n * ports:(n + 1) * ports]} for n in range(nodes)]
    doc["mirror"].update(mirror)
    return doc


def check_placement(topo: Topology, plan: Plan) -> None:
    """Every stream placed once; every port and node within its limits; ranks by node name."""
    limit = {n.name: n.max_ingest_gbps for n in topo.cpu_nodes}
    speed = {(sw.name, p.name): p.speed_gbps for sw in topo.leaf_switches for p in sw.ports}
    ingest: dict[str, float] = defaultdict(float)
    on_port: dict[tuple[str, str], float] = defaultdict(float)
    for group in plan.groups:
        names = [s.name for s in group.sources]
        assert len(names) == len(set(names)) == topo.mirror.sources_per_group
        listed = [name for node in group.cpu_nodes for name in node.sources]
        assert sorted(listed) == sorted(names)  # each source on exactly one node of the group
        by_node = {node.name: set(node.sources) for node in group.cpu_nodes}
        for s in group.sources:
            assert s.name in by_node[s.cpu_node]
            ingest[s.cpu_node] += s.load_gbps
            on_port[s.dest_switch, s.dest_port] += s.load_gbps
        assert len({(s.cpu_node, s.cpu_nic) for s in group.sources}) == len(names)  # distinct ports
        assert [n.rank for n in group.cpu_nodes] == list(range(len(group.cpu_nodes)))
        assert [n.name for n in group.cpu_nodes] == sorted(by_node)
    for node, gbps in ingest.items():
        assert gbps <= limit[node] + 1e-9
    for port, gbps in on_port.items():
        assert gbps <= speed[port] * topo.mirror.cpu_port_max_utilization + 1e-9


def lacking_share(n_ranks: int, n_nodes: int, streams: list[tuple[int, str]]) -> tuple[list[int], float]:
    """Chunks a node's streams miss and its bytes lacking over bytes mirrored, from runRing's replay:
    the hop into position r is r-1's egress."""
    hops = [h for position, direction in streams
            for h in {"egress": [position], "ingress": [position - 1], "both": [position, position - 1]}[direction]]
    carried = set().union(*(allgather_chunks_sent(h % n_ranks, n_ranks) for h in hops))
    missing = sorted(set(range(n_ranks)) - carried)
    # Its shard is 1/n_nodes of G; each hop mirrors n_ranks - 1 chunk sends of G/n_ranks per phase.
    lacking = len(missing) / n_ranks / n_nodes
    mirrored = len(hops) * 2 * (n_ranks - 1) / n_ranks
    return missing, lacking / mirrored


def test_a_group_too_big_for_one_node_is_spread_and_keeps_its_reliability():
    doc = two_nodes()
    plan = plan_of(doc)
    check_placement(parse_topology(doc), plan)
    (group,) = plan.groups
    assert [(n.name, n.sources) for n in group.cpu_nodes] == [("ckpta", ["m0", "m1"]), ("ckptb", ["m2"])]
    # The same sources on one node that can take them: the same coverage and P(fail).
    alone = plan_of(edited(doc, **{"cpu_nodes.0.max_ingest_gbps": 300}))
    assert [n.name for n in alone.groups[0].cpu_nodes] == ["ckpta"]
    assert [(s.position, s.direction) for s in alone.groups[0].sources] == \
        [(s.position, s.direction) for s in group.sources]
    assert (group.coverage, group.p_fail_exact, group.p_fail_eq2) == \
        (alone.groups[0].coverage, alone.groups[0].p_fail_exact, alone.groups[0].p_fail_eq2)
    assert [n.name for n in plan.cpu_nodes] == ["ckpta", "ckptb"]
    assert report_dict(plan)["cost"]["plan"]["cpu_nodes"] == 2


def test_what_each_node_lacks_is_what_runring_leaves_out_of_its_streams():
    for doc in (two_nodes(), two_nodes(ingest=100, nodes=3), two_nodes(sources_per_group=4),
                edited(two_nodes(ingest=200, nodes=3), **{"mirror.directions": ["ingress", "egress"]})):
        plan = plan_of(doc)
        for group in plan.groups:
            sources = {s.name: s for s in group.sources}
            for node in group.cpu_nodes:
                streams = [(sources[n].position, sources[n].direction) for n in node.sources]
                missing, share = lacking_share(group.size, len(group.cpu_nodes), streams)
                assert node.uncovered_chunks == missing
                assert node.exchange_share == pytest.approx(share, rel=1e-12)


def test_each_node_gets_streams_that_cover_what_it_steps_where_the_topology_allows():
    # Four sources, two nodes of two streams: 2 + 2, both nodes carry every chunk; also on nodes
    # that take three, which the greedy alone would fill 3 + 1.
    for ingest in (200, 300):
        plan = plan_of(two_nodes(sources_per_group=4, ingest=ingest))
        assert [len(n.sources) for n in plan.groups[0].cpu_nodes] == [2, 2]
        assert all(not n.uncovered_chunks and n.exchange_share == 0 for n in plan.groups[0].cpu_nodes)
    # Three sources, nodes of two: one node must hold one egress stream and lacks 1/8 of its shard.
    (a, b) = plan_of(two_nodes()).groups[0].cpu_nodes
    assert (a.uncovered_chunks, len(b.uncovered_chunks)) == ([], 1)
    assert b.exchange_share == pytest.approx(1 / (2 * 2 * 7 * 1))  # 1/(2 W (N-1) hops) = 3.57 %
    # With `both` allowed and 200G ports, each node takes one both-mirror: two hops, every chunk.
    doc = two_nodes(ingest=200, nodes=3, ports=1, cpu_speed=200, directions=["egress", "both"])
    plan = plan_of(doc)
    check_placement(parse_topology(doc), plan)
    assert [(len(n.sources), n.uncovered_chunks) for n in plan.groups[0].cpu_nodes] == [(1, [])] * 3
    assert {s.direction for s in plan.groups[0].sources} == {"both"}


@settings(max_examples=40, deadline=None)
@given(dp=st.integers(3, 8), nodes=st.integers(1, 4), ports=st.integers(1, 3), cpu_speed=st.sampled_from([100, 200]),
       ingest=st.sampled_from([100, 200, 300, 1000]), sources=st.integers(3, 4),
       directions=st.sets(st.sampled_from(["egress", "ingress", "both"]), min_size=1))
def test_any_spread_keeps_the_rules_or_is_refused(dp, nodes, ports, cpu_speed, ingest, sources, directions):
    assume(sources <= dp)
    doc = two_nodes(dp=dp, ingest=ingest, ports=ports, nodes=nodes, cpu_speed=cpu_speed, sources_per_group=sources,
                    directions=sorted(directions))
    try:
        plan = plan_of(doc)
    except ConfigError as exc:
        assert "is infeasible" in str(exc) and "no plan was made" in str(exc)
        return
    check_placement(parse_topology(doc), plan)
    (group,) = plan.groups
    if ports >= sources and ingest == 1000 and cpu_speed == 200:
        assert not group.spread  # the first node takes every candidate stream
    sources_of = {s.name: s for s in group.sources}
    coverage = [0] * dp
    for node in group.cpu_nodes:
        streams = [(sources_of[n].position, sources_of[n].direction) for n in node.sources]
        missing, share = lacking_share(dp, len(group.cpu_nodes), streams)
        assert node.uncovered_chunks == missing and node.exchange_share == pytest.approx(share, rel=1e-12)
        for position, direction in streams:
            for hop in {"egress": [position], "ingress": [position - 1], "both": [position, position - 1]}[direction]:
                for chunk in allgather_chunks_sent(hop % dp, dp):
                    coverage[chunk] += 1
    assert group.coverage == coverage


def test_a_group_that_fits_one_node_stays_on_one():
    for name in SHIPPED:
        if name == "mirror-group-two-nodes":
            continue
        assert all(len(g.cpu_nodes) == 1 for g in shipped_plan(name).groups), name
    spread = shipped_plan("mirror-group-two-nodes")
    assert [len(g.cpu_nodes) for g in spread.groups] == [2]


def test_the_refusal_names_the_limit_that_failed():
    message = infeasible(two_nodes(ingest=100, nodes=2))
    assert "CPU node ckpta takes in at most 100 Gbps (cpu_nodes max_ingest_gbps) and has 0 left" in message
    assert "spread over the 2 CPU nodes with a free DP-group slot (ckpta, ckptb), only 2 fit" in message
    ports = infeasible(two_nodes(ingest=1000, ports=1, nodes=2))
    assert "no unused port on leaf0 (or reachable by ERSPAN) has 100 Gbps free to mirror egress" in ports
    assert "only 2 fit" in ports and "takes in at most" not in ports
    # A node that hosts another group's appliance already has no slot to join this group.
    assert "every CPU node already hosts its max_dp_groups" in infeasible(two_groups(two_nodes()))


def two_groups(doc: dict) -> dict:
    """``doc`` laid out as two DP groups of 4 (TP 2: two GPUs per server)."""
    doc = edited(doc, **{"layout": {"dp": 4, "tp": 2}})
    doc["gpu_nodes"] = [{"name": f"gpu{n}", "gpus": [{"nic": f"nic{g}", "switch": "leaf0",
                                                      "port": f"Ethernet{2 * n + g}"} for g in range(2)]}
                        for n in range(4)]
    return doc


def test_ingest_limit_is_validated_and_rail_fabric_sets_it():
    with pytest.raises(ConfigError, match=r"cpu_nodes\[0\]\.max_ingest_gbps: 0 is not allowed"):
        parse_topology(two_nodes(ingest=0))
    with pytest.raises(ConfigError, match=r"cpu_nodes\[0\]\.address: 'a b' is not allowed"):
        parse_topology(edited(two_nodes(), **{"cpu_nodes.0.address": "a b"}))
    topo = load_topology(EXAMPLES / "gpt-175b-1536gpu.yaml")
    assert {n.max_ingest_gbps for n in topo.cpu_nodes} == {2457.6}  # the documented default
    doc = yaml.safe_load((EXAMPLES / "gpt-175b-1536gpu.yaml").read_text())
    doc["rail_fabric"]["cpu_node_max_ingest_gbps"] = 1200
    assert {n.max_ingest_gbps for n in parse_topology(doc).cpu_nodes} == {1200}


def test_the_report_lists_each_groups_nodes_streams_shares_and_ingest():
    plan = plan_of(two_nodes())
    report = json.loads(json.dumps(report_dict(plan)))
    (group,) = report["groups"]
    assert group["cpu_nodes"] == ["ckpta", "ckptb"]
    assert [(n["name"], n["rank"], n["sources"], n["load_gbps"], n["uncovered_chunks"]) for n in group["nodes"]] == [
        ("ckpta", 0, ["m0", "m1"], 200, []), ("ckptb", 1, ["m2"], 100, [3])]
    assert group["nodes"][1]["exchange_share"] == pytest.approx(1 / 28)
    assert [(n["name"], n["load_gbps"], n["max_ingest_gbps"]) for n in report["cpu_nodes"]] == [
        ("ckpta", 200, 200), ("ckptb", 100, 200)]
    assert report["job"]["mirror_groups"] == 1


def test_an_older_plan_with_one_cpu_node_per_group_loads(tmp_path):
    plan = plan_topology(load_topology(EXAMPLES / "flowcheck-testbed.yaml"))
    data = json.loads(plan.model_dump_json())
    for group in data["groups"]:
        group["cpu_node"] = group.pop("cpu_nodes")[0]["name"]
    for node in data["cpu_nodes"]:
        for key in ("max_ingest_gbps", "address", "group_interface"):
            node.pop(key)
    (tmp_path / "plan.json").write_text(json.dumps(data))
    old = load_plan(tmp_path / "plan.json")
    assert old.groups == plan.groups
    data["groups"][0]["sources"] = 7
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"groups\[0\]"):
        load_plan(tmp_path / "plan.json")


def test_a_plan_whose_nodes_contradict_its_sources_is_refused(tmp_path):
    data = json.loads(shipped_plan("mirror-group-two-nodes").model_dump_json())
    data["groups"][0]["cpu_nodes"][1]["sources"] = ["m9"]
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"groups\[0\]: cpu_nodes list m0 on ckpt-a, m1 on ckpt-a, m9 on ckpt-b, "
                                          r"but the sources are .*m2 on ckpt-b \(the plan is damaged"):
        load_plan(tmp_path / "plan.json")
    data = json.loads(shipped_plan("mirror-group-two-nodes").model_dump_json())
    data["groups"][0]["cpu_nodes"].reverse()
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"must be ranked 0..1 in name order"):
        load_plan(tmp_path / "plan.json")


# --- the job specs it writes ------------------------------------------------------------------

def ring_job(ranks: int) -> dict:
    """configs/small.yaml with a ring of ``ranks`` ranks: a job spec for a DP group of that size."""
    job = yaml.safe_load(shipped("small.yaml").read_text())
    job["ring"]["ranks"] = [{"ip": f"198.18.{i}.1", "mac": f"02:00:00:00:{i // 256:02x}:{i % 256:02x}"}
                            for i in range(ranks)]
    return job


def check_specs(plan: Plan, out: Path, rendezvous: Rendezvous, whole: bool = True) -> None:
    """Load every file the plan wrote as a job spec (``whole``: written with ``--job``; else
    sections, dropped into a job spec) and check its streams and mirror group."""
    def load(path: Path):
        if whole:
            return load_job(path)
        return parse_job({**ring_job(plan.groups[0].size), **yaml.safe_load(path.read_text())}, str(path))

    addresses = {n.name: n.address or n.name for n in plan.cpu_nodes}
    urls: dict[str, str] = {}
    for group in plan.groups:
        expected = [s.name for s in group.sources]
        if not group.spread:
            job = load(out / "mirrors" / f"{group.id}.yaml")
            assert [m.name for m in job.mirrors] == expected and job.appliance.mirror_group is None
            continue
        specs = [load(out / "mirrors" / f"{group.id}.{n.name}.yaml").appliance.mirror_group
                 for n in group.cpu_nodes]
        assert sorted(s.rank for s in specs) == list(range(len(specs)))
        assert {s.world_size for s in specs} == {len(group.cpu_nodes)}
        assert len({s.rendezvous for s in specs}) == 1 and {s.timeout_s for s in specs} == {rendezvous.timeout_s}
        # Every node lists every node's streams by rank: its own are the ones placed on it.
        owners = {s.name: s.cpu_node for s in group.sources}
        for node, spec in zip(group.cpu_nodes, specs):
            assert [{owners[name] for name in names} for names in spec.streams] == [{n.name} for n in group.cpu_nodes]
            assert set(spec.streams[spec.rank]) == {name for name, owner in owners.items() if owner == node.name}
        url = specs[0].rendezvous
        rank0 = next(n.name for n, s in zip(group.cpu_nodes, specs) if s.rank == 0)
        assert rank0 == min(n.name for n in group.cpu_nodes)
        if rendezvous.shared_dir is None:
            assert url.rpartition(":")[0] == f"tcp://{addresses[rank0]}"
        else:
            assert url.startswith(f"file://{rendezvous.shared_dir}/")
        urls[group.id] = url
    assert len(set(urls.values())) == len(urls)  # no two groups meet at one place


@pytest.mark.slow
@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_topology_writes_job_specs_that_load(name, tmp_path):
    plan = shipped_plan(name)
    sizes = {g.size for g in plan.groups}
    assert len(sizes) == 1  # one job spec serves every group of a shipped topology's size
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(ring_job(sizes.pop())))
    write_plan_dir(plan, tmp_path / "plan", Rendezvous(), job=str(tmp_path / "job.yaml"))
    written = sorted((tmp_path / "plan" / "mirrors").iterdir())
    assert len(written) == sum(len(g.cpu_nodes) for g in plan.groups)
    check_specs(plan, tmp_path / "plan", Rendezvous())
    # Without --job, the sections drop into the job spec.
    for file in spec_files(plan)[:8]:
        parse_job({**ring_job(file.group.size), **yaml.safe_load(file.text())}, file.path)


def test_the_two_node_example_writes_each_nodes_mirror_group(tmp_path):
    plan = shipped_plan("mirror-group-two-nodes")
    write_plan_dir(plan, tmp_path, Rendezvous(port_base=29600, timeout_s=30))
    a, b = (yaml.safe_load((tmp_path / "mirrors" / f"tp0-pp0.{n}.yaml").read_text()) for n in ("ckpt-a", "ckpt-b"))
    assert a["mirrors"] == b["mirrors"] and [m["name"] for m in a["mirrors"]] == ["m0", "m1", "m2"]
    assert a["appliance"]["mirror_group"] == {"rank": 0, "world_size": 2, "rendezvous": "tcp://10.0.9.1:29600",
                                              "timeout_s": 30, "streams": [["m0", "m1"], ["m2"]],
                                              "interface": "mgmt0"}
    assert b["appliance"]["mirror_group"] == {**a["appliance"]["mirror_group"], "rank": 1}
    assert not (tmp_path / "mirrors" / "tp0-pp0.yaml").exists()
    text = (tmp_path / "mirrors" / "tp0-pp0.ckpt-b.yaml").read_text()
    assert "this one captures m2 (NIC nic0): gradtap run JOB --stream m2=IFACE" in text
    assert "lack allgather chunk(s) 3 of every bucket" in text and "3.57% of its mirrored bytes" in text
    shared = Rendezvous(shared_dir=PurePosixPath("/shared/gradtap"))
    write_plan_dir(plan, tmp_path / "file", shared)
    check_specs(plan, tmp_path / "file", shared, whole=False)
    section = yaml.safe_load((tmp_path / "file" / "mirrors" / "tp0-pp0.ckpt-a.yaml").read_text())
    assert section["appliance"]["mirror_group"]["rendezvous"] == \
        "file:///shared/gradtap/gradtap-mirror-group-two-nodes-tp0-pp0"


def test_ports_count_up_per_rank_0_node_and_addresses_come_from_the_topology(tmp_path):
    # Nodes of two 200G ports: no node takes a group's three streams, both groups go 2 + 1.
    doc = two_groups(two_nodes(ingest=400, ports=2, cpu_speed=200))
    for node, address in zip(doc["cpu_nodes"], ("fd00::a", None)):
        node.update(max_dp_groups=2, address=address)
    topo = parse_topology(doc)
    plan = plan_topology(topo)
    check_placement(topo, plan)
    assert [[n.name for n in g.cpu_nodes] for g in plan.groups] == [["ckpta", "ckptb"], ["ckpta", "ckptb"]]
    urls = [f.section["appliance"]["mirror_group"]["rendezvous"] for f in spec_files(plan) if f.node == "ckpta"]
    assert urls == ["tcp://[fd00::a]:29500", "tcp://[fd00::a]:29501"]
    with pytest.raises(ConfigError, match=r"--rendezvous-port 65535: CPU node ckpta is rank 0 of 2 mirror groups, "
                                          r"which need ports up to 65536"):
        spec_files(plan, Rendezvous(port_base=65535))
    write_plan_dir(plan, tmp_path, Rendezvous())
    for path in (tmp_path / "mirrors").iterdir():
        parse_job({**ring_job(4), **yaml.safe_load(path.read_text())}, str(path))
    assert Counter(p.name.split(".")[0] for p in (tmp_path / "mirrors").iterdir()) == {"tp0-pp0": 2, "tp1-pp0": 2}


def test_bad_rendezvous_options_and_a_job_of_another_ring_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"--rendezvous-dir 'shared' is not an absolute path"):
        Rendezvous(shared_dir=PurePosixPath("shared"))
    with pytest.raises(ConfigError, match=r"--rendezvous-port 0 is not a TCP port"):
        Rendezvous(port_base=0)
    with pytest.raises(ConfigError, match=r"--group-timeout nan is not allowed"):
        Rendezvous(timeout_s=float("nan"))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(ring_job(4)))
    with pytest.raises(ConfigError, match=r"job.yaml: ring.ranks lists 4 ranks, but DP group tp0-pp0 has 8"):
        write_plan_dir(shipped_plan("mirror-group-two-nodes"), tmp_path / "out", job=str(tmp_path / "job.yaml"))
    assert not (tmp_path / "out").exists()  # nothing written when a spec is refused


def test_plan_command_writes_whole_job_specs(tmp_path):
    from tests.netconfig.test_cli import gradtap

    (tmp_path / "job.yaml").write_text(yaml.safe_dump(ring_job(8)))
    done = gradtap("netconfig", "plan", str(EXAMPLES / "mirror-group-two-nodes.yaml"), "--out", str(tmp_path / "o"),
                   "--job", str(tmp_path / "job.yaml"), "--rendezvous-port", "29700", "--group-timeout", "20")
    assert done.exit_code == 0, done.output
    assert "Mirror groups" in done.stdout and "3.57%" in done.stdout
    assert "wrote" in done.stdout and "2 job specs" in " ".join(done.stdout.split())
    job = load_job(tmp_path / "o" / "mirrors" / "tp0-pp0.ckpt-b.yaml")
    assert (job.name, job.appliance.mirror_group.rank, job.appliance.mirror_group.rendezvous,
            job.appliance.mirror_group.timeout_s) == ("small", 1, "tcp://10.0.9.1:29700", 20)
    refused = gradtap("netconfig", "plan", str(EXAMPLES / "mirror-group-two-nodes.yaml"), "--job", "x.yaml")
    assert refused.exit_code == 2 and "--job completes the job specs written to --out DIR" in refused.output
    save_plan(shipped_plan("mirror-group-two-nodes"), tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json") == shipped_plan("mirror-group-two-nodes")


@pytest.mark.slow
def test_the_nodes_run_from_the_specs_the_plan_wrote_and_equal_the_single_appliance(tmp_path):
    """End to end: plan a 3-rank group over two CPU nodes (2 + 1 streams), complete a simulated
    job's spec with each node's sections, replay each node from its own spec alone (no --group
    flags) in its own process; their joined snapshot is the single appliance's replica."""
    from gradtap.replay import run_replay
    from tests.forked import run_clis
    from tests.gradtap.test_group_cli import free_port
    from tests.gradtap.test_group_replay import ITERATIONS, assert_group_snapshot, clipped_job
    from tests.gradtap.test_replay import start_of, streams_of
    from tests.simulator.test_simulate import simulate

    doc = two_nodes(dp=3)
    for node in doc["cpu_nodes"]:
        node["address"] = "127.0.0.1"
    plan = plan_of(doc)
    assert [n.sources for n in plan.groups[0].cpu_nodes] == [["m0", "m1"], ["m2"]]
    job = clipped_job()
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job.model_dump(mode="json", exclude_none=True)))
    write_plan_dir(plan, tmp_path / "plan", Rendezvous(port_base=free_port(), timeout_s=120),
                   job=str(tmp_path / "job.yaml"))
    specs = [tmp_path / "plan" / "mirrors" / f"tp0-pp0.{n}.yaml" for n in ("ckpta", "ckptb")]
    planned = load_job(specs[0])
    simulate(tmp_path / "sim", planned, iterations=ITERATIONS)
    paths = streams_of(tmp_path / "sim", planned)
    _, single = run_replay(planned, paths, tmp_path / "single", start_of(tmp_path / "sim"), batch_frames=512)
    root = Path(__file__).resolve().parents[2]
    done = run_clis([("replay", str(spec), *(f"{name}={paths[name]}" for name in names), "--start",
                      str(tmp_path / "sim" / "truth" / "start.pt"), "--out", str(tmp_path / f"node{rank}"))
                     for rank, (spec, names) in enumerate(zip(specs, (["m0", "m1"], ["m2"])))],
                    cwd=root, env={"COLUMNS": "120"})
    for rank, node in enumerate(done):
        text = node.stdout + node.stderr
        assert node.returncode == 0, text
        report = json.loads((tmp_path / f"node{rank}" / "replay.json").read_text())
        assert [line["recovered"] for line in report["iterations"]] == [True] * ITERATIONS, text
        assert not report["stale"] and report["group"]["rank"] == rank
    assert_group_snapshot(tmp_path, planned, tmp_path / "sim", 2, single.replica)
