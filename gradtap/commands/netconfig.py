"""``gradtap netconfig plan | render | apply | teardown``: from a cluster topology to switch mirroring."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from gradtap.cli import app
from gradtap.core.errors import ConfigError
from gradtap.netconfig.linux_mirror import apply_mirrors, plan_mirrors, teardown_mirrors
from gradtap.netconfig.plan import load_plan, mirrors_yaml, save_plan
from gradtap.netconfig.planner import plan_topology
from gradtap.netconfig.render import format_configs, render_plan, write_configs
from gradtap.netconfig.report import print_report, report_dict
from gradtap.netconfig.topology import load_topology
from gradtap.netconfig.vendors import VENDORS

console = Console()
netconfig_app = typer.Typer(name="netconfig", no_args_is_help=True,
                            help="Plan which switch ports to mirror, render vendor configs, apply them on Linux.")
app.add_typer(netconfig_app, name="netconfig")


def write_plan_dir(plan, out: Path) -> list[Path]:
    """``plan.json``, ``report.json`` and one job-spec ``mirrors/<group>.yaml`` per DP group."""
    (out / "mirrors").mkdir(parents=True, exist_ok=True)
    save_plan(plan, out / "plan.json")
    (out / "report.json").write_text(json.dumps(report_dict(plan), indent=2) + "\n")
    written = [out / "plan.json", out / "report.json"]
    for group in plan.groups:
        path = out / "mirrors" / f"{group.id}.yaml"
        path.write_text(mirrors_yaml(plan, group))
        written.append(path)
    return written


@netconfig_app.command("plan")
def plan_command(
    topology: Path = typer.Argument(..., exists=True, dir_okay=False, help="cluster topology YAML"),
    out: Path = typer.Option(None, "--out", "-o", help="write plan.json, report.json and mirrors/<group>.yaml here"),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON instead of tables"),
) -> None:
    """Choose mirror sources per DP group, assign CPU-node ports, and report reliability and cost."""
    plan = plan_topology(load_topology(topology))
    written = write_plan_dir(plan, out) if out else []
    if as_json:
        typer.echo(json.dumps(report_dict(plan), indent=2))
    else:
        print_report(plan, console)
        if written:
            console.print(f"wrote {out / 'plan.json'}, {out / 'report.json'} and {len(plan.groups)} job-spec "
                          f"mirror sections under {out / 'mirrors'}")


@netconfig_app.command("render")
def render_command(
    plan: Path = typer.Argument(..., exists=True, dir_okay=False, help="plan.json from `gradtap netconfig plan`"),
    vendor: str = typer.Option(None, "--vendor", help=f"override each switch's vendor: {', '.join(VENDORS)}"),
    switch: list[str] = typer.Option([], "--switch", help="render only this switch (repeatable)"),
    out: Path = typer.Option(None, "--out", "-o", help="write one file per switch and kind here"),
) -> None:
    """Render each switch's mirror configuration and its matching teardown."""
    configs = render_plan(load_plan(plan), vendor, switch or None)
    if out:
        for path in write_configs(configs, out):
            console.print(f"wrote {path}")
    else:
        typer.echo(format_configs(configs), nl=False)


def _require_linux(linux: bool) -> None:
    if not linux:
        raise ConfigError("only Linux mirroring can be applied directly (pass --linux); for switches, use "
                          "`gradtap netconfig render PLAN --vendor V` and load the output")


def _mirror_table(title: str, rows: list[tuple[str, list]]) -> Table:
    table = Table(title=title)
    for column in ("interface", "hook", "mirrored to", "result"):
        table.add_column(column)
    for result, mirrors in rows:
        for m in mirrors:
            table.add_row(m.ifname, m.hook, m.dest_ifname, result)
    return table


@netconfig_app.command("apply")
def apply_command(
    plan: Path = typer.Argument(..., exists=True, dir_okay=False, help="plan.json"),
    linux: bool = typer.Option(False, "--linux", help="apply with tc through netlink on this host"),
    switch: str = typer.Option(None, "--switch", help="the plan's switch this host is (if several mirror)"),
    netns: str = typer.Option(None, "--netns", help="network namespace holding the switch's interfaces"),
) -> None:
    """Install the plan's mirroring on Linux interfaces (idempotent)."""
    _require_linux(linux)
    name, mirrors = plan_mirrors(load_plan(plan), switch)
    result = apply_mirrors(mirrors, netns)
    console.print(_mirror_table(f"{name}: mirror filters (classifier: {result.classifier or 'unchanged'})",
                                [("created", result.created), ("replaced", result.replaced),
                                 ("already in place", result.unchanged)]))


@netconfig_app.command("teardown")
def teardown_command(
    plan: Path = typer.Argument(..., exists=True, dir_okay=False, help="plan.json"),
    linux: bool = typer.Option(False, "--linux", help="remove the tc mirroring through netlink on this host"),
    switch: str = typer.Option(None, "--switch", help="the plan's switch this host is (if several mirror)"),
    netns: str = typer.Option(None, "--netns", help="network namespace holding the switch's interfaces"),
) -> None:
    """Remove exactly the mirroring `apply` installs (idempotent)."""
    _require_linux(linux)
    name, mirrors = plan_mirrors(load_plan(plan), switch)
    result = teardown_mirrors(mirrors, netns)
    console.print(_mirror_table(f"{name}: mirror filters", [("removed", result.removed),
                                                           ("was not there", result.absent)]))
    if result.qdiscs_removed:
        console.print(f"removed the now-empty clsact qdisc of {', '.join(result.qdiscs_removed)}")
