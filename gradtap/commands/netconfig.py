"""``gradtap netconfig plan | render | apply | teardown``: from a cluster topology to switch mirroring."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from gradtap.cli import Group, app
from gradtap.core.errors import ConfigError

if TYPE_CHECKING:
    from rich.console import Console

netconfig_app = Group("netconfig", help="Plan which switch ports to mirror, render vendor configs, apply them on "
                                        "Linux.")
app.add_command(netconfig_app)

# The names of ``gradtap.netconfig.vendors.VENDORS``, for the help text, which must not import
# the renderers (pydantic); tests/gradtap/test_cli.py checks that the two agree.
VENDOR_NAMES = ("sonic", "eos", "nxos", "comware", "junos", "nvue", "linux")


def _plan_file(metavar: str, help: str):
    """An argument naming an existing file (a topology or a plan)."""
    return click.argument(metavar.lower(), type=click.Path(exists=True, dir_okay=False, path_type=Path),
                          metavar=metavar, help=help)


_plan_argument = _plan_file("PLAN", "plan.json from `gradtap netconfig plan`")


def _switch_and_netns(command):
    """``--switch``, ``--netns`` and ``--state``, as ``apply`` and ``teardown`` both take them."""
    command = click.option("--state", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
                           help="record of what apply installed (default: "
                                "/var/lib/gradtap/netconfig/SWITCH[@NS].json)")(command)
    command = click.option("--netns", metavar="NS", help="network namespace holding the switch's interfaces")(command)
    return click.option("--switch", metavar="SWITCH",
                        help="the plan's switch this host is (if several mirror)")(command)


def write_plan_dir(plan, out: Path, rendezvous=None, job: str | None = None) -> list[Path]:
    """``plan.json``, ``report.json`` and the job-spec sections: ``mirrors/<group>.yaml`` per DP group
    on one CPU node, ``mirrors/<group>.<node>.yaml`` per node of a group spread over several (with its
    ``appliance.mirror_group``; ``rendezvous`` a :class:`~gradtap.netconfig.job_specs.Rendezvous`).
    With ``job`` (a job-spec path, ``{group}`` standing for the group id) each file is that job spec
    completed with the sections, validated. Every file is checked before any is written."""
    from gradtap.netconfig.job_specs import Rendezvous, complete_job, job_document, spec_files
    from gradtap.netconfig.plan import save_plan
    from gradtap.netconfig.report import report_dict

    texts = []
    documents: dict[str, dict] = {}
    for file in spec_files(plan, rendezvous or Rendezvous()):
        if job is None:
            texts.append((file.path, file.text()))
            continue
        path = job.replace("{group}", file.group.id)
        if path not in documents:
            documents[path] = job_document(path)
        texts.append((file.path, complete_job(documents[path], file, path)))
    (out / "mirrors").mkdir(parents=True, exist_ok=True)
    save_plan(plan, out / "plan.json")
    (out / "report.json").write_text(json.dumps(report_dict(plan), indent=2) + "\n")
    written = [out / "plan.json", out / "report.json"]
    for name, text in texts:
        (out / name).write_text(text)
        written.append(out / name)
    return written


def _sci(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def _between(iterations: float | None) -> str:
    return "unbounded" if iterations is None else f"{iterations:.3g}"


def print_plan_report(report: dict, console: Console) -> None:
    """``report_dict(plan)`` as tables: per DP group, per mirror source, per switch, per CPU
    node, then the job's failure probability and cost."""
    from gradtap.tables import table

    groups = table(f"DP groups ({report['topology']}, loss p = {report['loss_rate']:g}, "
                   f"K = {report['packets_per_iteration']:g} packets/iteration)",
                   "group", "ranks", "CPU node(s)", "min\nc_k", "P(fail)\nexact", "P(fail)\nEq. 2",
                   "iterations\nbetween\nfailures", numeric=("ranks", "min\nc_k"))
    sources = table("Mirror sources per DP group", "group", "source: position, direction, switch port -> "
                                                            "CPU node NIC (encapsulation)")
    members = table("Mirror groups: DP groups whose streams arrive at several CPU nodes", "group", "rank",
                    "CPU node", "streams", "load\nGbps", "exchange\nshare", numeric=("rank", "load\nGbps",
                                                                                      "exchange\nshare"),
                    caption="exchange share: bytes its peers send it / bytes its streams mirror")
    for g in report["groups"]:
        groups.add_row(g["id"], str(g["ranks"]), ", ".join(g["cpu_nodes"]), str(g["min_chunk_coverage"]),
                       _sci(g["p_fail_exact"]), _sci(g["p_fail_eq2"]), _between(g["iterations_between_failures"]))
        sources.add_row(g["id"], "\n".join(g["sources"]))
        if len(g["nodes"]) > 1:
            for n in g["nodes"]:
                members.add_row(g["id"], str(n["rank"]), n["name"], ", ".join(n["sources"]), f"{n['load_gbps']:g}",
                                f"{n['exchange_share']:.2%}")
    switches = table("Mirror sessions per switch", "switch", "vendor", "sources", "sessions", "limit", "free\nports",
                     numeric=("sources", "sessions", "limit", "free\nports"))
    for s in report["switches"]:
        switches.add_row(s["switch"], s["vendor"], str(s["sources"]), str(s["sessions"]),
                         "none" if s["session_limit"] is None else str(s["session_limit"]), str(s["free_ports"]))
    nodes = table("CPU mirror nodes", "CPU node", "DP groups", "ingest\nGbps", "ports\nGbps", "ingest\nlimit",
                  numeric=("ingest\nGbps", "ports\nGbps", "ingest\nlimit"),
                  caption="ingest: all its streams at line rate; limit: max_ingest_gbps")
    for n in report["cpu_nodes"]:
        limit = n["max_ingest_gbps"]
        nodes.add_row(n["name"], ", ".join(n["groups"]), f"{n['load_gbps']:g}", f"{n['capacity_gbps']:g}",
                      "n/a" if limit is None else f"{limit:g}")
    shown = (groups, sources, members, switches, nodes) if report["job"]["mirror_groups"] else \
        (groups, sources, switches, nodes)
    for t in shown:
        console.print(t)
    for route in report["erspan_routes"]:
        console.print(f"ERSPAN route: {route}")
    if report["fabric"]:
        fabric = report["fabric"]
        console.print(f"spine: {fabric['spine_load_gbps']:.4g} of {fabric['spine_free_gbps']:g} Gbps free taken by ERSPAN")
    for warning in report["warnings"]:
        console.print(f"warning: {warning}")
    job, cost = report["job"], report["cost"]
    console.print(f"job: {job['dp_groups']} DP groups ({job['mirror_groups']} over several CPU nodes), "
                  f"P(any group fails per iteration) = "
                  f"{_sci(job['p_fail_exact'])} exact, {_sci(job['p_fail_eq2'])} Eq. 2; expected iterations "
                  f"between failures: {_between(job['iterations_between_failures'])}")
    print_cost(cost, console)


def _usd(value: float) -> str:
    return f"{value:,.2f}"


def print_cost(cost: dict, console: Console) -> None:
    """The report's ``cost`` section: USD a day with ordinary checkpoints and with gradtap (this
    plan's CPU nodes, and the reference count when there is one), its inputs, and CPU-node sizing."""
    from gradtap.tables import table

    runs = [("this plan", cost["plan"], cost["sizing"]["plan"])]
    if cost["reference"]:
        runs.append(("reference", cost["reference"], cost["sizing"]["reference"]))
    heads = [f"gradtap,\n{name}:\n{run['cpu_nodes']} CPU nodes" for name, run, _ in runs]
    days = table(f"Cost, USD/day ({cost['gpus']} GPUs, {cost['gpu_servers']:g} servers)", "",
                 "ordinary\ncheckpoints", *heads, numeric=("ordinary\ncheckpoints", *heads))
    ordinary = runs[0][1]["ordinary_usd_per_day"]
    days.add_row("lost work", _usd(ordinary["lost_work"]), *(_usd(r["gradtap_usd_per_day"]["lost_work"])
                                                              for _, r, _ in runs))
    days.add_row("save stall", _usd(ordinary["stall"]), *("" for _ in runs))
    days.add_row("CPU nodes", "", *(_usd(r["gradtap_usd_per_day"]["cpu_nodes"]) for _, r, _ in runs))
    days.add_row("total", _usd(ordinary["total"]), *(_usd(r["gradtap_usd_per_day"]["total"]) for _, r, _ in runs))
    days.add_row("ordinary / gradtap", "", *("n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x"
                                              for _, r, _ in runs))
    inputs = table("Cost inputs", "input", "value", "from", numeric=("value",),
                   caption="FlowCheck default: the paper's input (EuroSys '25, § on cost)")
    for name, value in cost["inputs"].items():
        if name in cost["sources"]:
            inputs.add_row(name, f"{value:g}", cost["sources"][name])
    console.print(days)
    console.print(inputs)
    for name, _, size in runs:
        limit = size["ingest_limit_gbps"]
        ingest = "" if limit is None else (f"; a node takes in {limit:,.6g} Gbps"
                                           + (" (exceeded)" if size["gbps_per_node"] > limit + 1e-9 else ""))
        console.print(f"CPU nodes, {name}: {size['cpu_nodes']} x {size['dp_groups_per_node']} DP groups = "
                      f"{size['streams_per_node']} streams, {size['gbps_per_node']:,.4g} Gbps at line rate per "
                      f"node: {size['ports_per_node']} ports of {size['port_gbps']:g} Gbps{ingest}")


@netconfig_app.command("plan")
@_plan_file("TOPOLOGY", "cluster topology YAML")
@click.option("--out", "-o", type=click.Path(path_type=Path), metavar="DIR",
              help="write plan.json, report.json and the job-spec sections mirrors/<group>[.<node>].yaml here")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON instead of tables")
@click.option("--job", metavar="JOB", help="with --out: write whole job specs, this one (a path; {group} stands for "
                                           "the DP group id) completed with each group's and node's sections")
@click.option("--rendezvous-port", type=int, default=29500, show_default=True, metavar="PORT",
              help="mirror groups meet over TCP at their rank-0 node, from this port up")
@click.option("--rendezvous-dir", metavar="DIR",
              help="mirror groups meet through a file in DIR instead, a directory every CPU node mounts")
@click.option("--group-timeout", type=float, default=60.0, show_default=True, metavar="SECONDS",
              help="the mirror groups' longest wait for a peer")
def plan_command(topology: Path, out: Path | None, as_json: bool, job: str | None, rendezvous_port: int,
                 rendezvous_dir: str | None, group_timeout: float) -> None:
    """Choose mirror sources per DP group, assign CPU-node ports (several nodes per group when one
    cannot take its streams), and report reliability and cost."""
    from pathlib import PurePosixPath

    from rich.console import Console

    from gradtap.netconfig.job_specs import Rendezvous
    from gradtap.netconfig.planner import plan_topology
    from gradtap.netconfig.report import report_dict
    from gradtap.netconfig.topology import load_topology

    if job and not out:
        raise click.UsageError("--job completes the job specs written to --out DIR; give --out")
    rendezvous = Rendezvous(rendezvous_port, PurePosixPath(rendezvous_dir) if rendezvous_dir else None,
                            group_timeout)
    plan = plan_topology(load_topology(topology))
    written = write_plan_dir(plan, out, rendezvous, job) if out else []
    if as_json:
        click.echo(json.dumps(report_dict(plan), indent=2))
    else:
        console = Console()
        print_plan_report(report_dict(plan), console)
        if written:
            console.print(f"wrote {out / 'plan.json'}, {out / 'report.json'} and {len(written) - 2} "
                          f"{'job specs' if job else 'job-spec sections'} under {out / 'mirrors'}")


@netconfig_app.command("render")
@_plan_argument
@click.option("--vendor", metavar="VENDOR", help=f"override each switch's vendor: {', '.join(VENDOR_NAMES)}")
@click.option("--switch", multiple=True, metavar="SWITCH", help="render only this switch (repeatable)")
@click.option("--out", "-o", type=click.Path(path_type=Path), metavar="DIR",
              help="write one file per switch and kind here")
def render_command(plan: Path, vendor: str | None, switch: tuple[str, ...], out: Path | None) -> None:
    """Render each switch's mirror configuration and its matching teardown."""
    from gradtap.netconfig.plan import load_plan
    from gradtap.netconfig.render import format_configs, render_plan, write_configs

    configs = render_plan(load_plan(plan), vendor, list(switch) or None)
    if out:
        for path in write_configs(configs, out):
            click.echo(f"wrote {path}")
    else:
        click.echo(format_configs(configs), nl=False)


def _require_linux(linux: bool) -> None:
    if not linux:
        raise ConfigError("only Linux mirroring can be applied directly (pass --linux); for switches, use "
                          "`gradtap netconfig render PLAN --vendor V` and load the output")


def _print_mirrors(console: Console, title: str, rows: list[tuple[str, list]]) -> None:
    from gradtap.tables import table

    t = table(title, "interface", "hook", "mirrored to", "result")
    for result, mirrors in rows:
        for m in mirrors:
            t.add_row(m.ifname, m.hook, m.dest_ifname, result)
    console.print(t)


@netconfig_app.command("apply")
@_plan_argument
@click.option("--linux", is_flag=True, help="apply with tc through netlink on this host")
@_switch_and_netns
def apply_command(plan: Path, linux: bool, switch: str | None, netns: str | None, state: Path | None) -> None:
    """Install the plan's mirroring on Linux interfaces and record it (idempotent; rolled back on
    failure; mirrors of the previous record that the plan lacks are removed)."""
    _require_linux(linux)
    from rich.console import Console

    from gradtap.netconfig.linux_mirror import apply_recorded, default_state_path, plan_mirrors
    from gradtap.netconfig.plan import load_plan

    name, mirrors = plan_mirrors(load_plan(plan), switch)
    record = state or default_state_path(name, netns)
    result = apply_recorded(name, mirrors, record, netns)
    console = Console()
    _print_mirrors(console, f"{name}: mirror filters (classifier: {result.classifier or 'unchanged'})",
                   [("created", result.created), ("replaced", result.replaced), ("already in place", result.unchanged),
                    ("removed (no longer planned)", result.stale_removed)])
    console.print(f"recorded in {record}")


@netconfig_app.command("teardown")
@click.argument("plan", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path), metavar="[PLAN]",
                help="plan.json from `gradtap netconfig plan`, only to name the switch (or give --switch or --state)")
@click.option("--linux", is_flag=True, help="remove the tc mirroring through netlink on this host")
@_switch_and_netns
def teardown_command(plan: Path | None, linux: bool, switch: str | None, netns: str | None,
                     state: Path | None) -> None:
    """Remove the mirroring `apply` recorded on this host (idempotent). PLAN only names the
    switch: what is removed is what the record holds."""
    _require_linux(linux)
    from rich.console import Console

    from gradtap.netconfig.linux_mirror import default_state_path, plan_mirrors, teardown_recorded
    from gradtap.netconfig.plan import load_plan

    if state is None:
        if switch is None and plan is None:
            raise ConfigError("name the switch whose mirrors to remove: --switch SWITCH, a PLAN, or --state FILE")
        state = default_state_path(switch or plan_mirrors(load_plan(plan), None)[0], netns)
    record, result = teardown_recorded(state)
    console = Console()
    _print_mirrors(console, f"{record.switch}: mirror filters",
                   [("removed", result.removed), ("was not there", result.absent)])
    if result.qdiscs_removed:
        console.print(f"removed the clsact qdisc gradtap had added to {', '.join(result.qdiscs_removed)}")
    if result.qdiscs_kept:
        console.print(f"kept the clsact qdisc of {', '.join(result.qdiscs_kept)}: it was there before gradtap")
    console.print(f"removed the record {state}")
