"""Checkpoint files are input, not code: every ``torch.load`` in gradtap passes
``weights_only=True``, so a crafted pickle named by a job spec or offered for a resync cannot
run code (torch's weights-only unpickler admits tensors and plain containers only)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_layers import production_modules


def test_every_torch_load_is_weights_only():
    offenders = []
    for name, path in production_modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
                kw = {k.arg: k.value for k in node.keywords}
                if not (isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True):
                    offenders.append(f"{Path(path).name}:{node.lineno}")
    assert offenders == []
