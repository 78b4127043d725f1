"""``gradtap.out_dir.published``: an output directory appears whole or not at all."""

from __future__ import annotations

import pytest

from gradtap.core.errors import ConfigError
from gradtap.out_dir import published


def test_the_directory_appears_only_when_the_block_ends(tmp_path):
    out = tmp_path / "sub" / "out"
    with published(out, force=False) as tmp:
        (tmp / "a").write_text("1")
        assert not out.exists()
    assert (out / "a").read_text() == "1"
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]


def test_an_error_leaves_nothing_and_keeps_the_old_directory(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("kept")
    with pytest.raises(RuntimeError), published(out, force=True) as tmp:
        (tmp / "new").write_text("half")
        raise RuntimeError("writer failed")
    assert [p.name for p in out.iterdir()] == ["old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_force_replaces_and_refusal_names_the_fix(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("x")
    with pytest.raises(ConfigError, match=r"--out .*out: exists; give a new directory, or --force"):
        with published(out, force=False):
            pass
    with published(out, force=True) as tmp:
        (tmp / "new").write_text("y")
    assert [p.name for p in out.iterdir()] == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
