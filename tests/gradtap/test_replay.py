"""The appliance end to end over simulated captures: bit-exact replica, resume, fallback, resync."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch

from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import PcapWriter, read_pcap
from gradtap.commands.replay import run_replay
from gradtap.core.errors import ConfigError
from gradtap.replay import match_streams
from gradtap.verify import verify
from gradtap.simulator.run import resume
from gradtap.simulator.truth import optimizer_arrays
from tests import naive
from tests.parser import naive_coverage
from tests.simulator.test_simulate import make_job, simulate
from gradtap.updater import snapshot
from gradtap.workload.layout import job_params, job_plan
from gradtap.workload.spec import load_job
from gradtap.workload.wire_plan import PHASE_AG, PSN_MOD

ROOT = Path(__file__).resolve().parents[2]
FAULTS = "mirror_loss=1e-3,link_loss=1e-3,corrupt=1e-3,reorder=1e-3,duplicate=1e-3"


def streams_of(out: Path, job) -> dict[str, Path]:
    return {m.name: out / "streams" / f"{m.name}.pcap" for m in job.mirrors}


def start_of(out: Path) -> dict:
    return torch.load(out / "truth" / "start.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["Simple", "LL", "LL128"])
def test_replica_equals_the_trainer_after_every_iteration(tmp_path, protocol):
    job = make_job(4, protocol, 2, "fp32", nqps=2, mtu=1024)
    simulate(tmp_path / "sim", job, iterations=4, faults=FAULTS)
    _, sink = run_replay(job, streams_of(tmp_path / "sim", job), tmp_path / "replay", start_of(tmp_path / "sim"),
                         batch_frames=512, show_progress=False)
    v = verify(tmp_path / "replay", tmp_path / "sim" / "truth", job_params(job))
    assert v.ok and not v.stale, v
    assert v.digests_checked == [1, 2, 3, 4]
    assert not sink.replica.stale and sink.replica.iteration == 5


@pytest.mark.slow
def test_small_config_with_adamw_clipping_and_schedule(tmp_path):
    from gradtap.simulator.faults import parse_faults
    from gradtap.simulator.run import Simulation
    job = load_job(ROOT / "configs" / "small.yaml")
    Simulation(job, tmp_path / "sim", iterations=3, seed=1,
               faults=parse_faults(FAULTS, tuple(m.name for m in job.mirrors))).run()
    run_replay(job, streams_of(tmp_path / "sim", job), tmp_path / "replay", start_of(tmp_path / "sim"),
               show_progress=False)
    v = verify(tmp_path / "replay", tmp_path / "sim" / "truth", job_params(job))
    assert v.ok and v.digests_checked == [1, 2, 3] and v.snapshots_checked


@pytest.mark.slow
def test_a_trainer_resumed_from_a_snapshot_continues_bit_for_bit(tmp_path):
    job = make_job(3, "LL", 2, "fp32")
    simulate(tmp_path / "sim", job, iterations=4)
    run_replay(job, streams_of(tmp_path / "sim", job), tmp_path / "replay", start_of(tmp_path / "sim"),
               show_progress=False)
    snap = sorted((tmp_path / "replay" / "snapshots").glob("iteration-*"))[0]
    # The two lines a trainer runs (docs/updater.md), into a real torch training loop.
    model_sd = torch.load(snap / "model.pt", weights_only=True)
    optim_sd = torch.load(snap / "optimizer.pt", weights_only=True)
    k = snapshot.verify(snap)["iteration"]
    assert k < 5
    trainer = resume(job, {"model": model_sd, "optimizer": optim_sd, "iteration": k}, seed=7, until=5)
    resumed = optimizer_arrays(trainer.model, trainer.optimizer)
    with np.load(tmp_path / "sim" / "truth" / "iter_000004" / "state.npz") as truth:
        for key in truth.files:
            assert resumed[key].tobytes() == truth[key].tobytes(), key


def drop_allgather(out: Path, job, ordinal: int, bucket: int) -> int:
    """Rewrite every stream's capture without the allgather frames of one bucket of one
    iteration (ordinal since the capture began), so that no stream covers those blocks."""
    plan = job_plan(job)
    ranks = {r.ip: i for i, r in enumerate(job.ring.ranks)}
    dropped = 0
    for m in job.mirrors:
        path = out / "streams" / f"{m.name}.pcap"
        first = naive_coverage.first_psns(path, job, plan)
        batch = read_pcap(path)
        keep = []
        for i, (o, c) in enumerate(zip(batch.offsets, batch.caplens)):
            f, _ = naive.decode_frame(bytes(batch.data[o:o + c]))
            if f is not None and 0x06 <= f["opcode"] <= 0x0B and f["ip_src"] in ranks and f["ip_dst"] in ranks:
                flow = naive_coverage._flow(plan, ranks[f["ip_src"]], ranks[f["ip_dst"]], f["dest_qp"])
                if flow is not None:
                    it, pos = divmod((f["psn"] - first[flow]) % PSN_MOD, int(plan.flows["npkts"][flow]))
                    msgs = plan.flow_messages(flow)
                    w = msgs[np.searchsorted(msgs["psn_offset"], pos, side="right") - 1]
                    if it == ordinal and w["phase"] == PHASE_AG and w["bucket"] == bucket:
                        dropped += 1
                        continue
            keep.append(i)
        keep = np.asarray(keep)
        with PcapWriter(path) as w:
            w.write_batch(FrameBatch(batch.data, batch.offsets[keep], batch.caplens[keep], batch.wirelens[keep],
                                     batch.ts_ns[keep], batch.linktype))
    return dropped


class _Trainer(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append(json.loads(body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def trainer_endpoint():
    _Trainer.received = []
    server = HTTPServer(("127.0.0.1", 0), _Trainer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/gradtap/fallback", _Trainer.received
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_unrecoverable_iteration_falls_back_marks_stale_and_resync_restores_exactness(tmp_path, trainer_endpoint):
    url, received = trainer_endpoint
    job = make_job(3, "LL", 2, "fp32")
    job = job.model_copy(update={"appliance": job.appliance.model_copy(update={"control_endpoint": url})})
    simulate(tmp_path / "sim", job, iterations=5)
    assert drop_allgather(tmp_path / "sim", job, ordinal=2, bucket=0) > 0
    # The trainer's regular checkpoint after the lost iteration (3): what it sends when asked.
    checkpoint = resume(job, start_of(tmp_path / "sim"), seed=7, until=4).state_dict()
    _, sink = run_replay(job, streams_of(tmp_path / "sim", job), tmp_path / "replay", start_of(tmp_path / "sim"),
                         show_progress=False, resync=[checkpoint])
    events = [json.loads(line) for line in (tmp_path / "replay" / "events.jsonl").read_text().splitlines()]
    fallback = [e for e in events if e["event"] == "fallback"]
    assert [e["iteration"] for e in fallback] == [3]
    assert [e["iteration"] for e in received] == [3] and received[0]["request"] == "regular_checkpoint"
    assert [e["iteration"] for e in events if e["event"] == "resync"] == [4]
    v = verify(tmp_path / "replay", tmp_path / "sim" / "truth", job_params(job))
    assert v.ok and v.stale == [3] and v.digests_checked == [1, 2, 4, 5]
    # The snapshots never hold the half-applied iteration: one ready for 3, then 5 and 6.
    ready = [snapshot.verify(p)["iteration"] for p in sorted((tmp_path / "replay" / "snapshots").glob("iteration-*"))]
    assert 4 not in ready
    assert not sink.replica.stale


def test_stream_names_and_files_are_checked(tmp_path):
    job = make_job(2, "LL", 1, "fp32")
    (tmp_path / "m-egress.pcap").write_bytes(b"")
    with pytest.raises(ConfigError, match="not a mirror stream"):
        match_streams(job, [str(tmp_path / "other.pcap")])
    with pytest.raises(ConfigError, match="not a file"):
        match_streams(job, ["m-both=" + str(tmp_path / "missing.pcap")])
    assert match_streams(job, [str(tmp_path / "m-egress.pcap")]) == {"m-egress": tmp_path / "m-egress.pcap"}
