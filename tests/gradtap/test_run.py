"""`gradtap run` as a process and its metrics: clean ends, clear failures, honest counters."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import urllib.request

import numba
import numpy as np
import pytest
import torch

from gradtap import metrics
from gradtap.appliance import Appliance, RunOptions, pipeline_cores
from gradtap.capture.ring import FrameRing
from gradtap.capture.worker import SourceSpec
from gradtap.pipeline import Cores
from gradtap.store import snapshot
from gradtap.updater.replica import seed_checkpoint
from gradtap.verify import verify
from gradtap.workload.layout import job_params
from gradtap.workload.spec import dump_job
from tests.capture.netlab import remove_stale
from tests.simulator.test_simulate import make_job, simulate


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_run_over_pcap_sources_serves_metrics_and_ends_cleanly(tmp_path):
    job = make_job(3, "LL", 2, "fp32")
    simulate(tmp_path / "sim", job, iterations=3)
    streams = {m.name: SourceSpec("pcap", (str(tmp_path / "sim" / "streams" / f"{m.name}.pcap"),), {})
               for m in job.mirrors}
    start = torch.load(tmp_path / "sim" / "truth" / "start.pt", weights_only=True)
    appliance = Appliance(job, streams, tmp_path / "run", start,
                          RunOptions(ring_slots=4096, slot_size=4352, hugepages="off", digests=True))
    assert (tmp_path / "run" / "events.jsonl").read_text() == ""        # there to follow from the start
    port = free_port()
    metrics.serve(appliance.status, port)
    result = appliance.run()
    assert result.exit_code == 0 and result.reason == "every source ended" and result.unrecoverable == 0
    assert verify(tmp_path / "run", tmp_path / "sim" / "truth", job_params(job)).ok
    # The replica and its last snapshot against the trainer's state itself, not only through verify.
    with np.load(tmp_path / "sim" / "truth" / "iter_000003" / "state.npz") as truth:
        for name, value in appliance.replica.state_dict()["model"].items():
            assert value.numpy().tobytes() == truth[f"param/{name}"].tobytes(), name
        latest = snapshot.latest(tmp_path / "run" / "snapshots")
        moments = torch.load(latest / "optimizer.pt", weights_only=True)["state"]
        for i, p in enumerate(job_params(job)):
            assert moments[i]["exp_avg_sq"].numpy().tobytes() == truth[f"exp_avg_sq/{p.name}"].tobytes(), p.name
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    frames = {line.split("{")[1].split("}")[0]: float(line.split()[-1])
              for line in body.splitlines() if line.startswith("gradtap_frames_total{")}
    assert set(frames) == {f'stream="{m.name}"' for m in job.mirrors} and all(v > 0 for v in frames.values())
    assert 'gradtap_iterations_total{result="recovered"} 3.0' in body
    counts = appliance.status().snapshots              # written in the background (appliance.snapshot_buffers)
    assert counts["written"] >= 1 and counts["failed"] == 0, counts
    assert counts["last_written"] == appliance.replica.iteration, counts         # the final one, at the end
    assert f'gradtap_snapshots_total{{result="written"}} {float(counts["written"])}' in body
    assert 'gradtap_decode_events_total{event="data.written"' in body
    assert "gradtap_replica_stale 0.0" in body
    # An update thread (where this host leaves it a core: gradtap.pipeline.overlapping) shows its backlog.
    beside = appliance.pipeline.update is not None
    assert ("gradtap_update_backlog 0.0" in body) == beside and ("gradtap_update_backlog" in body) == beside
    # Shared gradients made after start-up are counted. Pcap sources of this small job run apart:
    # a stream's ring holds several of its iterations, so one parser enters iterations the
    # others still hold buffers for (4 in a run here). More are made and counted when every buffer is
    # held and one more iteration entered.
    pool = appliance.pipeline.pool
    late = appliance.status().gradients_made_late
    assert late == pool.fresh and f"gradtap_gradients_made_late_total {float(late)}" in body
    for k in range(pool.buffers + 1):
        pool.enter(1000 + k)
    assert appliance.status().gradients_made_late == pool.fresh > late
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert f"gradtap_gradients_made_late_total {float(pool.fresh)}" in body


def test_a_round_reads_a_quarter_of_the_ring_unless_told():
    """The rounds' size follows the ring (what the capture keeps to write into while a round
    holds its slots), and an explicit ``batch_frames`` wins."""
    assert RunOptions().round_frames == RunOptions().ring_slots // 4 == 16384
    assert RunOptions(ring_slots=4096).round_frames == 1024
    assert RunOptions(ring_slots=2).round_frames == 1
    assert RunOptions(ring_slots=4096, batch_frames=300).round_frames == 300


@pytest.mark.slow
def test_the_update_thread_runs_on_its_own_cores_and_the_replica_is_exact(tmp_path, monkeypatch):
    """``--parse-cpus`` on one core: the update thread takes the others (``pipeline_cores``),
    beside the parsers, pinned there, and the replica is the trainer's. Every round reads at
    most ``round_frames`` of each ring."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip(f"this process may run on one core ({cores}): no core for an update thread beside the parser")
    job = make_job(3, "Simple", 2, "fp32")
    simulate(tmp_path / "sim", job, iterations=3)
    streams = {m.name: SourceSpec("pcap", (str(tmp_path / "sim" / "streams" / f"{m.name}.pcap"),), {})
               for m in job.mirrors}
    start = torch.load(tmp_path / "sim" / "truth" / "start.pt", weights_only=True)
    options = RunOptions(ring_slots=4096, slot_size=4352, hugepages="off", digests=True, parse_cpus=cores[:1])
    assert pipeline_cores(options) == Cores(frozenset(cores[:1]), frozenset(cores[1:]))
    asked = []
    read = FrameRing.read

    def reading(ring, max_frames, *args, **kwargs):
        asked.append((ring, max_frames))
        return read(ring, max_frames, *args, **kwargs)

    monkeypatch.setattr(FrameRing, "read", reading)
    appliance = Appliance(job, streams, tmp_path / "run", start, options)
    assert appliance.pipeline.update is not None, "no update thread beside a parser pinned to one core"
    seen = set()
    bucket = appliance.sink.bucket

    def noting(*args):
        seen.add((threading.current_thread().name, frozenset(os.sched_getaffinity(0)), numba.get_num_threads()))
        bucket(*args)

    appliance.sink.bucket = noting
    threads = numba.get_num_threads()
    try:
        result = appliance.run()
        parse_threads = numba.get_num_threads()
    finally:
        os.sched_setaffinity(0, cores)      # run() pinned this thread to the parse core
        numba.set_num_threads(threads)
    assert result.exit_code == 0 and result.unrecoverable == 0, result
    assert {n for ring, n in asked if ring in appliance.rings.values()} == {options.round_frames} == {1024}
    assert seen == {("gradtap-update", frozenset(cores[1:]), min(len(cores) - 1, numba.config.NUMBA_NUM_THREADS))}
    assert appliance.status().update_backlog == 0
    assert parse_threads == 1, "the thread that parses on one core would run its kernels on more threads"
    assert verify(tmp_path / "run", tmp_path / "sim" / "truth", job_params(job)).ok
    with np.load(tmp_path / "sim" / "truth" / "iter_000003" / "state.npz") as truth:
        for name, value in appliance.replica.state_dict()["model"].items():
            assert value.numpy().tobytes() == truth[f"param/{name}"].tobytes(), name


def test_status_never_holds_the_pipeline_while_it_waits_for_the_replica(tmp_path):
    """With the update thread in an Adam pass (it holds the replica's lock), a status read
    waits for it without holding the pipeline's lock, so the next round can start. Holding
    both would stall the parsers behind every metrics scrape that falls in an update."""
    job = make_job(3, "Simple", 2, "fp32")
    streams = {m.name: SourceSpec("pcap", (str(tmp_path / f"{m.name}.pcap"),), {}) for m in job.mirrors}
    appliance = Appliance(job, streams, tmp_path / "run", seed_checkpoint(job, 0), RunOptions(hugepages="off"))
    try:
        done = []
        with appliance._replica_lock:
            reader = threading.Thread(target=lambda: done.append(appliance.status()))
            reader.start()
            reader.join(0.2)
            assert not done, "status() read the replica while its lock was held"
            assert appliance._lock.acquire(timeout=10), "status() holds the pipeline's lock while it waits"
            appliance._lock.release()
        reader.join(10)
        assert len(done) == 1 and done[0].replica_iteration == 0
    finally:
        appliance.pipeline.close()


def test_cores_the_process_may_not_run_on_are_refused_by_name(tmp_path):
    from click.testing import CliRunner

    from gradtap.cli import _register, app
    from gradtap.core.errors import ConfigError
    _register()
    job = seed_started_job()
    (tmp_path / "job.yaml").write_text(dump_job(job))
    foreign = max(os.sched_getaffinity(0)) + 1
    done = CliRunner().invoke(app, ["run", str(tmp_path / "job.yaml"), "--stream", "m-egress=lo", "--out",
                                    str(tmp_path / "out"), "--update-cpus", f"{min(os.sched_getaffinity(0))},{foreign}",
                                    "--no-rehearsal"])
    assert isinstance(done.exception, ConfigError), done.output
    assert f"--update-cpus: core(s) [{foreign}] are not among the cores this process may run on" in str(done.exception)


def seed_started_job():
    """A job an appliance may start from its seed: in DDP's initial bucket layout, whose traffic
    begins at iteration 0 (a rebuilt layout refuses a start at iteration 0)."""
    job = make_job(2, "LL", 1, "fp32")
    return job.model_copy(update={"ddp": job.ddp.model_copy(update={"layout": "initial"})})


def test_a_missing_interface_fails_fast_with_its_reason(tmp_path):
    job = seed_started_job()
    (tmp_path / "job.yaml").write_text(dump_job(job))
    env = {**os.environ, "COLUMNS": "400"}
    done = subprocess.run([sys.executable, "-c", "from gradtap.cli import main; main()", "run",
                           str(tmp_path / "job.yaml"),
                           "--stream", "m-egress=gradtap-no-such-if0", "--out", str(tmp_path / "out"),
                           "--metrics-port", "0", "--no-status", "--hugepages", "off", "--ring-slots", "64",
                           "--slot-size", "2048"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode != 0
    assert "no interface 'gradtap-no-such-if0'" in done.stderr, done.stderr[-2000:]
    assert "rehearsal" not in done.stderr and "start state" not in done.stderr      # named before either


def test_source_options_reach_every_stream_and_a_wrong_one_is_named():
    """``--source-option KEY=VALUE`` goes into each stream's source, checked by building the
    source in the parent: an option the source lacks, or a value it refuses, is a ConfigError
    that names it before any worker starts."""
    from gradtap.commands.run import parse_source_options, parse_stream
    from gradtap.core.errors import ConfigError

    given = parse_source_options(("rx_size=131072", "frames=0x40000", "mode=copy"))
    assert given == {"rx_size": 131072, "frames": 262144, "mode": "copy"}
    name, spec = parse_stream("r0=eth2", "af_xdp", "cpu0", given)
    assert (name, spec.source, spec.args) == ("r0", "af_xdp", ("eth2",))
    assert spec.options == {"netns": "cpu0", "rx_size": 131072, "frames": 262144, "mode": "copy"}
    assert parse_stream("r0=pcap:x.pcap", "af_xdp", None, {"max_frames": 64})[1].options == {"max_frames": 64}
    with pytest.raises(ConfigError, match=r"--source-option, stream 'r0': capture source af_packet: no option "
                                          r"rx_size; it takes netns, block_size, block_count, block_timeout_ms"):
        parse_stream("r0=eth2", "af_packet", None, {"rx_size": 4096})
    with pytest.raises(ConfigError, match=r"stream 'r0': capture source af_xdp: rx_size = 100; must be a power of "
                                          r"two >= 64"):
        parse_stream("r0=eth2", "af_xdp", None, {"rx_size": 100})
    with pytest.raises(ConfigError, match=r"capture source af_xdp: rx_size='big' is not a number \(default 16384\)"):
        parse_stream("r0=eth2", "af_xdp", None, {"rx_size": "big"})
    for bad in ("rx_size", "=5", "rx size=5", "rx_size="):
        with pytest.raises(ConfigError, match="expected KEY=VALUE"):
            parse_source_options((bad,))
    with pytest.raises(ConfigError, match="netns comes from --stream or --netns"):
        parse_source_options(("netns=cpu1",))


def test_a_wrong_source_option_stops_the_command_with_its_reason(tmp_path):
    job = seed_started_job()
    (tmp_path / "job.yaml").write_text(dump_job(job))
    env = {**os.environ, "COLUMNS": "400"}
    done = subprocess.run([sys.executable, "-c", "from gradtap.cli import main; main()", "run",
                           str(tmp_path / "job.yaml"), "--source", "af_xdp", "--source-option", "rx_size=100",
                           "--stream", "m-egress=gradtap-no-such-if0", "--out", str(tmp_path / "out"),
                           "--metrics-port", "0", "--no-status", "--no-rehearsal"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode != 0
    assert "rx_size = 100; must be a power of two >= 64" in done.stderr, done.stderr[-2000:]


def test_unknown_stream_names_are_refused(tmp_path):
    from gradtap.core.errors import ConfigError
    job = make_job(2, "LL", 1, "fp32")
    with pytest.raises(ConfigError, match="not mirror streams"):
        Appliance(job, {"nope": SourceSpec("pcap", ("x",), {})}, tmp_path, {})


@pytest.mark.privileged
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a network namespace and AF_PACKET")
def test_a_crashed_capture_worker_stops_the_appliance_with_an_error(tmp_path):
    import signal
    import threading
    from pyroute2 import NetNS, netns

    ns = f"gtrun{os.getpid()}"
    remove_stale()
    netns.create(ns)
    try:
        with NetNS(ns) as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
        job = make_job(2, "LL", 1, "fp32")
        streams = {"m-egress": SourceSpec("af_packet", ("lo",), {"netns": ns})}
        from gradtap.updater.replica import seed_checkpoint
        appliance = Appliance(job, streams, tmp_path, seed_checkpoint(job, 0),
                              RunOptions(ring_slots=256, slot_size=2048, hugepages="off"))
        result = {}
        runner = threading.Thread(target=lambda: result.update(r=appliance.run()), daemon=True)
        runner.start()
        assert appliance.ready.wait(120)
        os.kill(appliance.workers["m-egress"].pid, signal.SIGKILL)
        runner.join(timeout=30)
        assert not runner.is_alive(), "the appliance hung after its capture worker died"
        assert result["r"].exit_code != 0 and "m-egress" in result["r"].reason
        events = (tmp_path / "events.jsonl").read_text()
        assert '"stage_crashed"' in events
    finally:
        netns.remove(ns)


@pytest.mark.privileged
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a network namespace and AF_PACKET")
@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_gradtap_run_stops_cleanly_on_a_signal(tmp_path, signum):
    import signal
    import time
    from pyroute2 import NetNS, netns

    ns = f"gtsig{os.getpid()}"
    remove_stale()
    netns.create(ns)
    try:
        with NetNS(ns) as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
        job = seed_started_job()
        (tmp_path / "job.yaml").write_text(dump_job(job))
        # With SIGINT, as an operator at a terminal stops it: with the live status view.
        view = signum == "SIGINT"
        proc = subprocess.Popen([sys.executable, "-c", "from gradtap.cli import main; main()", "run",
                                 str(tmp_path / "job.yaml"), "--stream", "m-egress=lo", "--netns", ns,
                                 "--out", str(tmp_path / "out"), "--metrics-port", "0", "--control-port", "0",
                                 *([] if view else ["--no-status"]), "--hugepages", "off", "--ring-slots", "256",
                                 "--slot-size", "2048"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "FORCE_COLOR": "1", "COLUMNS": "80"} if view else None)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not (tmp_path / "out" / "snapshots").exists():
                time.sleep(0.2)
            time.sleep(3)                      # the capture worker is up and listening
            proc.send_signal(getattr(signal, signum))
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, err
        err = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", err)      # a terminal's colours and cursor moves
        assert "rehearsal: 2 iterations of a miniature of the job exact" in err and "gradtap run: stopped" in err
        # Refreshed every 0.5 s: the rates, from the second on.
        assert ("kpps" in err and "CPU %: of one core, each stream's capture worker; the appliance:" in err) == view
    finally:
        netns.remove(ns)


@pytest.mark.slow
def test_run_reads_an_auto_jobs_era_and_protocol_from_the_wire(tmp_path):
    """The live appliance told only ``era: auto`` and ``protocol: auto``: it holds the frames
    until a stream decides them, then replays them into parsers built for what it read."""
    job = make_job(3, "LL128", 2, "fp32", era="2.29")
    simulate(tmp_path / "sim", job, iterations=3)
    told = job.model_copy(update={"nccl": job.nccl.model_copy(update={"era": "auto", "protocol": "auto"})})
    streams = {m.name: SourceSpec("pcap", (str(tmp_path / "sim" / "streams" / f"{m.name}.pcap"),), {})
               for m in job.mirrors}
    start = torch.load(tmp_path / "sim" / "truth" / "start.pt", weights_only=True)
    appliance = Appliance(told, streams, tmp_path / "run", start,
                          RunOptions(ring_slots=4096, slot_size=4352, hugepages="off", digests=True))
    result = appliance.run()
    assert result.exit_code == 0 and result.unrecoverable == 0
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    resolved = [e for e in events if e["event"] == "job.resolved"]
    assert len(resolved) == 1 and "2.29" in resolved[0]["eras"] and set(resolved[0]["protocols"]) == {"LL128"}
    assert verify(tmp_path / "run", tmp_path / "sim" / "truth", job_params(job)).ok


@pytest.mark.slow
def test_run_over_files_that_never_lock_exits_non_zero(tmp_path):
    """A job spec the traffic contradicts (LL told, Simple sent): nothing locks, nothing is
    applied, and the run says so with a non-zero exit status, as ``gradtap replay`` does."""
    job = make_job(3, "Simple", 2, "fp32")
    simulate(tmp_path / "sim", job, iterations=2)
    told = job.model_copy(update={"nccl": job.nccl.model_copy(update={"protocol": "LL"})})
    streams = {m.name: SourceSpec("pcap", (str(tmp_path / "sim" / "streams" / f"{m.name}.pcap"),), {})
               for m in job.mirrors}
    start = torch.load(tmp_path / "sim" / "truth" / "start.pt", weights_only=True)
    appliance = Appliance(told, streams, tmp_path / "run", start,
                          RunOptions(ring_slots=4096, slot_size=4352, hugepages="off"))
    result = appliance.run()
    assert result.exit_code == 1 and "no stream locked" in result.reason and result.iterations == 0
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert sorted(e["stream"] for e in events if e["event"] == "lockon.failed") == sorted(streams)


def test_the_fallback_post_carries_the_token_the_control_server_checks(tmp_path):
    """``--control-token-file`` reaches the fallback POST as well as the control server, ahead
    of ``appliance.control_token_file`` and ``OUT/control.token``."""
    from gradtap.appliance import control_token_file

    job = seed_started_job()
    named = job.model_copy(update={"appliance": job.appliance.model_copy(
        update={"control_token_file": tmp_path / "job.token"})})
    flag = RunOptions(control_token_file=tmp_path / "flag.token")
    assert control_token_file(job, tmp_path / "out", RunOptions()) == tmp_path / "out" / "control.token"
    assert control_token_file(named, tmp_path / "out", RunOptions()) == tmp_path / "job.token"
    assert control_token_file(named, tmp_path / "out", flag) == tmp_path / "flag.token"
    from gradtap.updater.replica import seed_checkpoint
    appliance = Appliance(named, {}, tmp_path / "out", seed_checkpoint(named, 0), flag)
    assert appliance.control.token_file == tmp_path / "flag.token"
