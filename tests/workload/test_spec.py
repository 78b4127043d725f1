"""The job spec loads every shipped config and rejects bad input with errors that name the
field, the bad value and what is allowed."""

from pathlib import Path

import pytest
import yaml

from gradtap.core.errors import ConfigError
from gradtap.workload.spec import dump_job, load_job, parse_job
from tests.forked import run_cli

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))


def minimal(**overrides):
    doc = {
        "name": "t",
        "model": {"params": [{"name": "w", "shape": [4, 4]}]},
        "ring": {"ranks": [{"ip": "198.18.0.1", "mac": "02:00:00:00:00:01"},
                           {"ip": "198.18.1.1", "mac": "02:00:00:00:00:02"}]},
        "mirrors": [{"name": "m0", "rank": 0, "direction": "egress"}],
    }
    doc.update(overrides)
    return doc


def error_of(doc) -> str:
    with pytest.raises(ConfigError) as info:
        parse_job(doc, "job.yaml")
    return str(info.value)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    job = load_job(path)
    assert job.world_size >= 2
    assert parse_job(yaml.safe_load(dump_job(job))) == job


def test_configs_cover_the_three_required_jobs():
    names = {load_job(p).name: load_job(p) for p in CONFIGS}
    assert {"small", "gpt2-small", "flowcheck-testbed"} <= set(names)
    fc = names["flowcheck-testbed"]
    assert (fc.world_size, fc.nccl.protocol, fc.nccl.channels, fc.nccl.mtu, fc.ipv6) == (8, "LL", 1, 1024, True)
    assert names["gpt2-small"].world_size == 8
    assert 2 <= names["small"].world_size <= 4


def test_defaults_are_ncclss_and_ddps():
    job = parse_job(minimal())
    assert job.ddp.bucket_cap_mb is None
    assert job.nccl.era == "2.19" and job.nccl.qps_per_connection == 1
    assert job.optimizer.implementation == "single_tensor"


def test_bad_protocol_names_field_value_and_choices():
    msg = error_of(minimal(nccl={"protocol": "LL256"}))
    assert "nccl.protocol" in msg and "'LL256'" in msg and "'Simple'" in msg and "'LL128'" in msg


def test_bad_mtu():
    msg = error_of(minimal(nccl={"mtu": 1500}))
    assert "nccl.mtu" in msg and "1500" in msg and "4096" in msg


def test_unknown_field_is_named():
    msg = error_of(minimal(nccl={"protocl": "LL"}))
    assert "nccl.protocl" in msg


def test_unsupported_era_lists_supported_ones():
    msg = error_of(minimal(nccl={"era": "2.31"}))
    assert "nccl.era" in msg and "'2.31'" in msg and "2.19" in msg and "2.30" in msg


def test_mirror_rank_outside_ring():
    msg = error_of(minimal(mirrors=[{"name": "m0", "rank": 5, "direction": "egress"}]))
    assert "mirrors[0].rank" in msg and "5" in msg and "0..1" in msg


def test_mirror_direction_and_name():
    assert "mirrors[0].direction" in error_of(minimal(mirrors=[{"name": "m0", "rank": 0, "direction": "rx"}]))
    assert "mirrors[0].name" in error_of(minimal(mirrors=[{"name": "-bad", "rank": 0, "direction": "egress"}]))


def test_bad_address_and_mac():
    ranks = [{"ip": "300.1.1.1", "mac": "02:00:00:00:00:01"}, {"ip": "198.18.1.1", "mac": "zz"}]
    msg = error_of(minimal(ring={"ranks": ranks}))
    assert "ring.ranks[0].ip" in msg and "300.1.1.1" in msg
    assert "ring.ranks[1].mac" in msg


def test_duplicate_ranks_and_mixed_ip_versions():
    ranks = [{"ip": "198.18.0.1", "mac": "02:00:00:00:00:01"}, {"ip": "198.18.0.1", "mac": "02:00:00:00:00:02"}]
    assert "repeats ranks[0].ip" in error_of(minimal(ring={"ranks": ranks}))
    ranks = [{"ip": "198.18.0.1", "mac": "02:00:00:00:00:01"}, {"ip": "fe80::2", "mac": "02:00:00:00:00:02"}]
    assert "same IP version" in error_of(minimal(ring={"ranks": ranks}))


def test_model_needs_exactly_one_source():
    assert "exactly one of 'factory'" in error_of(minimal(model={}))
    assert "import path" in error_of(minimal(model={"factory": "not a path"}))


def test_explicit_layout_needs_buckets():
    assert "explicit" in error_of(minimal(ddp={"layout": "explicit"}))


def test_beta_range():
    msg = error_of(minimal(optimizer={"betas": [1.0, 0.999]}))
    assert "optimizer.betas[0]" in msg and "1.0" in msg


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_job(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_job(bad)
    bad.write_text("- a list")
    with pytest.raises(ConfigError, match="mapping"):
        load_job(bad)


# Issue 11: files that are no job spec at all are named, never a traceback.
NOT_TEXT = [
    pytest.param(b"name: small\n\xff\xfe\x00\x01", r"\(top level\): not a text file \(byte 0xff at offset 12 is not "
                 r"UTF-8\); a job spec is a YAML file such as configs/small\.yaml", id="binary"),
    pytest.param(b"\x1f\x8b\x08\x00" + bytes(range(256)), r"\(top level\): not a text file \(byte 0x8b at offset 1 ",
                 id="gzip"),
    pytest.param(bytes(4096), r"not valid YAML: unacceptable character #x0000", id="zeros"),
    pytest.param(b"[" * 100_000, r"\(top level\): nested too deeply for a job spec", id="deep"),
]


@pytest.mark.parametrize("content, message", NOT_TEXT)
def test_a_file_that_is_no_job_spec_is_named(tmp_path, content, message):
    path = tmp_path / "job.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=rf"^{path}: {message}"):
        load_job(path)


def test_the_command_line_says_so_without_a_traceback(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_bytes(NOT_TEXT[0].values[0])
    done = run_cli("replay", str(path), f"s={path}", "--out", str(tmp_path / "out"), timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"error: {path}: (top level): not a text file"), done.stderr
    assert not (tmp_path / "out").exists()
