"""Render a plan into per-switch vendor configurations and their teardowns."""

from __future__ import annotations

from pathlib import Path

from gradtap.netconfig import vendors
from gradtap.netconfig.plan import Plan
from gradtap.netconfig.vendors.base import SwitchConfig, build_sessions


def render_plan(plan: Plan, vendor: str | None = None, switches: list[str] | None = None) -> list[SwitchConfig]:
    """Configs for ``switches`` (default: every switch with mirror sources), in plan order.

    ``vendor`` overrides each switch's own vendor from the topology.
    """
    names = switches or [sw.name for sw in plan.switches if plan.sources_on(sw.name)]
    configs = []
    for name in names:
        switch = plan.switch(name)
        module = vendors.vendor(vendor or switch.vendor)
        sessions = build_sessions(module.SPEC, switch, plan.sources_on(name), plan.mirror)
        configs.append(module.render(switch, sessions))
    return configs


def format_configs(configs: list[SwitchConfig]) -> str:
    """All configs as one text, each file under a ``### <switch> <apply|teardown> <file>`` header."""
    parts = []
    for config in configs:
        for kind, files in (("apply", config.apply), ("teardown", config.teardown)):
            for suffix, text in files.items():
                parts.append(f"### {config.switch} {kind} {config.vendor}.{suffix}\n{text}")
    return "\n".join(parts)


def write_configs(configs: list[SwitchConfig], out_dir: str | Path) -> list[Path]:
    """Write ``<switch>.<vendor>.<suffix>`` and ``<switch>.teardown.<vendor>.<suffix>`` files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for config in configs:
        for kind, files in (("", config.apply), ("teardown.", config.teardown)):
            for suffix, text in files.items():
                path = out / f"{config.switch}.{kind}{config.vendor}.{suffix}"
                path.write_text(text)
                written.append(path)
    return written
