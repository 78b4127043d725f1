"""What gradtap installs: one top-level package, and a wheel that works outside a checkout.

The checkout keeps its folders at the top (they are the architecture), but an install must
land in one namespace: a wheel that installed ``parser`` or ``capture`` at the top level of
site-packages would break, or be broken by, any other distribution with a module of that name.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("core", "wire", "workload", "capture", "parser", "merger", "updater", "store", "netconfig", "simulator", "trainer")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out), str(ROOT)], check=True, capture_output=True, timeout=300)
    (built,) = out.glob("gradtap-*.whl")
    return built


def test_the_wheel_installs_one_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"gradtap", next(t for t in top if t.endswith(".dist-info"))}
    for stage in STAGES:
        assert f"gradtap/{stage}/__init__.py" in names, f"{stage}/ is not installed as gradtap.{stage}"
    assert not [n for n in names if n.startswith(("gradtap/tests/", "gradtap/benchmarks/"))]


def test_the_wheel_ships_the_configs(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for shipped in sorted((ROOT / "configs").rglob("*.yaml")):
        assert f"gradtap/configs/{shipped.relative_to(ROOT / 'configs')}" in names


@pytest.mark.slow
def test_demo_runs_from_the_wheel_outside_the_checkout(wheel, tmp_path):
    """A fresh venv holding only the wheel (its dependencies come from this venv's
    site-packages through a path entry, so the test installs nothing from the network) runs
    ``gradtap demo`` from a directory that is not the checkout."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    deps = [p for p in sys.path if p.endswith("site-packages")]
    # Plain path lines, not a site dir: this venv's own .pth files (the editable checkout's
    # finder among them) are not processed, so the only gradtap is the wheel's.
    Path(site, "zz_test_dependencies.pth").write_text("\n".join(deps) + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
                   check=True, timeout=300)
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GRADTAP_CAPTURES")}
    where = subprocess.run([str(python), "-c", "import gradtap, gradtap.parser; print(gradtap.parser.__file__)"],
                           cwd=away, env=env, check=True, capture_output=True, text=True).stdout
    assert where.startswith(site) and str(ROOT) not in where
    done = subprocess.run([str(venv / "bin" / "gradtap"), "demo"], cwd=away, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "bit-identical" in done.stdout, done.stdout[-2000:]
