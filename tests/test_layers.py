"""The house stands as DESIGN.md draws it, read from the imports between files.

Floors, bottom up: ``core`` (errors, Numba options, memory operations) and ``wire`` (RoCEv2
and NCCL on the wire) are the ground; ``workload`` (the job spec, its plan, the model
factories) is the contract on them; the stages stand on the contract; the shell
(``gradtap/``: the CLI, the pipeline, the control plane) is the roof. Every import is
counted, including the ones inside functions, which hide a cycle from the interpreter but
not from a reader.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROUND = ("core", "wire")
CONTRACT = ("workload",)
STAGES = ("capture", "parser", "merger", "updater", "store", "simulator", "netconfig", "trainer")
SHELL = "shell"                 # the gradtap/ folder itself
PACKAGES = GROUND + CONTRACT + STAGES + ("configs",)
FLOOR = {"core": 0, "wire": 1, "workload": 2, "configs": 2, **{s: 3 for s in STAGES}, SHELL: 4}


def module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "gradtap." + ".".join(parts[1:]) if parts[0] == "gradtap" else "gradtap." + ".".join(parts)


def package_of(module: str) -> str:
    part = module.split(".")[1] if module.count(".") else ""
    return part if part in PACKAGES else SHELL


def production_modules() -> dict[str, Path]:
    found = {}
    for top in PACKAGES + ("gradtap",):
        for path in (ROOT / top).rglob("*.py"):
            found[module_of(path)] = path
    return found


def imports() -> dict[str, set[str]]:
    """Module → the gradtap modules it imports (anywhere in its body)."""
    modules = production_modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for t in targets:
                if t in modules and t != name:
                    edges[name].add(t)
    return edges


def package_edges() -> dict[tuple[str, str], list[str]]:
    out: dict[tuple[str, str], list[str]] = defaultdict(list)
    for src, targets in imports().items():
        for dst in targets:
            a, b = package_of(src), package_of(dst)
            if a != b:
                out[(a, b)].append(f"{src} -> {dst}")
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_round_a_circle():
    assert cycles(imports()) == []


def test_no_package_imports_itself_round_a_circle():
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in package_edges():
        graph[a].add(b)
    assert cycles(graph) == []


def test_no_import_runs_from_a_lower_floor_to_a_higher_one():
    upward = {pair: where for pair, where in package_edges().items() if FLOOR[pair[0]] < FLOOR[pair[1]]}
    assert upward == {}


def test_the_ground_floor_imports_no_stage():
    for (a, b), where in package_edges().items():
        if a == "core":
            raise AssertionError(f"core imports {b}: {where}")
        if a == "wire":
            assert b == "core", where


def test_no_stage_imports_the_shell():
    assert [w for (a, b), w in package_edges().items() if b == SHELL] == []
