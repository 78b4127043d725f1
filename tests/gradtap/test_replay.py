"""The appliance end to end over simulated captures: bit-exact replica, resume, fallback, resync,
the merger's majority rule on a stream that lies, and DDP gradients summed rather than pre-divided."""

from __future__ import annotations

import gc
import json
import os
import re
import threading
import weakref
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch

from gradtap.capture.frames import FrameBatch
from benchmarks.replay import FLIPPED_BYTE, flipped_capture
from gradtap import pipeline as pipeline_module
from gradtap.capture.pcap import PcapWriter, read_pcap
from gradtap.core.errors import ConfigError
from gradtap.simulator.faults import parse_faults
from gradtap.simulator.run import Simulation
from gradtap.replay import match_streams, quiet_from, replay, run_replay
from gradtap.start import replica_start
from gradtap.verify import verify
from gradtap.simulator.run import resume
from gradtap.simulator.truth import optimizer_arrays
from tests import naive
from tests.parser import naive_coverage
from tests.simulator.test_simulate import make_job, simulate
from gradtap.store import snapshot
from gradtap.workload.layout import job_params, job_plan
from gradtap.wire.icrc import compute_icrc
from gradtap.wire.psn import PSN_MODULUS
from gradtap.workload.spec import dump_job, load_job, parse_job
from gradtap.workload.wire_plan import DATA, PHASE_AG
from gradtap.merger.merger import Merger
from gradtap.parser.shared_gradient import GradientPool
from gradtap.parser.stream import StreamParser
from gradtap.simulator.truth import iteration_dir
from gradtap.wire import events as ev
from tests.gradtap.test_buffers import Collect

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
                         batch_frames=512)
    v = verify(tmp_path / "replay", tmp_path / "sim" / "truth", job_params(job))
    assert v.ok and not v.stale, v
    assert v.digests_checked == [1, 2, 3, 4]
    assert not sink.replica.stale and sink.replica.iteration == 5


@pytest.mark.slow
def test_small_config_with_adamw_clipping_and_schedule(tmp_path):
    job = load_job(ROOT / "configs" / "small.yaml")
    Simulation(job, tmp_path / "sim", iterations=3, seed=1,
               faults=parse_faults(FAULTS, tuple(m.name for m in job.mirrors))).run()
    run_replay(job, streams_of(tmp_path / "sim", job), tmp_path / "replay", start_of(tmp_path / "sim"))
    v = verify(tmp_path / "replay", tmp_path / "sim" / "truth", job_params(job))
    assert v.ok and v.digests_checked == [1, 2, 3] and v.snapshots_checked


@pytest.mark.slow
def test_the_command_says_how_much_mirrored_traffic_it_processed(tmp_path):
    """``gradtap replay`` prints the rate a CPU node's ``max_ingest_gbps`` is measured by, and
    ``replay.json`` holds it: the captured frame bytes (each file's size less the pcap
    headers) over the replay's wall time, in all and per core."""
    from click.testing import CliRunner

    from gradtap.cli import _register, app

    _register()
    job = make_job(3, "Simple", 1, "fp32")
    simulate(tmp_path / "sim", job, iterations=2)
    (tmp_path / "job.yaml").write_text(dump_job(job))
    pcaps = streams_of(tmp_path / "sim", job)
    done = CliRunner().invoke(app, ["replay", str(tmp_path / "job.yaml"), *[f"{n}={p}" for n, p in pcaps.items()],
                                    "--out", str(tmp_path / "out"), "--start",
                                    str(tmp_path / "sim" / "truth" / "start.pt")])
    assert done.exit_code == 0, done.output
    report = json.loads((tmp_path / "out" / "replay.json").read_text())
    for name, path in pcaps.items():         # pcap: a 24-byte file header, and 16 bytes before each frame
        assert report["bytes"][name] == path.stat().st_size - 24 - 16 * report["frames"][name]
    total = sum(report["bytes"].values())
    assert report["mirrored_gbps"] == pytest.approx(8 * total / report["wall_s"] / 1e9)
    assert report["cores"] == len(os.sched_getaffinity(0))
    line = re.search(r"mirrored ([\d.]+) GB in ([\d.]+) s: ([\d.]+) Gb/s, ([\d.]+) Gb/s per core \((\d+) cores\)",
                     done.output)
    assert line, done.output
    assert float(line[1]) == pytest.approx(total / 1e9, abs=0.005)
    assert float(line[2]) == pytest.approx(report["wall_s"], abs=0.005)
    assert float(line[3]) == pytest.approx(report["mirrored_gbps"], abs=0.005)
    assert float(line[4]) == pytest.approx(report["mirrored_gbps"] / report["cores"], abs=0.005)
    assert int(line[5]) == report["cores"]


def tensors_of(state) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in tensors_of(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in tensors_of(v)]
    return []


def test_the_start_state_is_freed_once_the_replica_holds_it(tmp_path):
    """The start state is as large as the replica (12 B per parameter): a replay that kept it
    would hold both through the whole run (issue 12's memory per parameter)."""
    job = make_job(3, "Simple", 2, "fp32")
    simulate(tmp_path / "sim", job, iterations=2)
    checkpoint = start_of(tmp_path / "sim")
    held = [weakref.ref(t) for t in tensors_of(checkpoint)]
    assert len(held) > 3 * len(job_params(job)) - 1          # parameters and both moments
    start = replica_start(job, checkpoint, "truth/start.pt")
    del checkpoint
    alive: list[int] = []
    run_replay(job, streams_of(tmp_path / "sim", job), tmp_path / "replay", start,
               progress=lambda *_: alive.append(sum(r() is not None for r in held)))
    assert alive and max(alive) == 0, f"start tensors still alive during the replay: {alive}"
    assert start.checkpoint is None
    with pytest.raises(RuntimeError, match="taken already"):
        start.take_checkpoint()
    assert verify(tmp_path / "replay", tmp_path / "sim" / "truth", job_params(job)).ok


def test_the_start_up_heap_is_left_out_of_the_collector_while_the_rounds_run(tmp_path):
    """Python's full garbage collection walks every object it tracks: some 400 thousand once
    torch and Numba are loaded, 0.23 s with the parsers stalled (``benchmarks.live``). While the
    rounds run, what the process made before them is frozen out of it
    (``gradtap/pipeline.py``, ``start_up_frozen``), so a collection walks the rounds' own
    objects only; afterwards everything is collected as before."""
    job = make_job(3, "Simple", 2, "fp32")
    simulate(tmp_path / "sim", job, iterations=2)
    seen: list[tuple[int, int]] = []          # (objects frozen, objects the collector tracks)
    run_replay(job, streams_of(tmp_path / "sim", job), tmp_path / "replay", start_of(tmp_path / "sim"),
               progress=lambda *_: seen.append((gc.get_freeze_count(), len(gc.get_objects()))))
    assert seen
    for frozen, tracked in seen:
        assert frozen > 10 * tracked, seen[:3]
    assert gc.get_freeze_count() == 0
    assert verify(tmp_path / "replay", tmp_path / "sim" / "truth", job_params(job)).ok


@pytest.mark.parametrize("spares", [1, 0])
def test_a_replay_says_how_many_gradient_buffers_it_made_late(tmp_path, monkeypatch, spares):
    """Rounds much shorter than an iteration: with the pipeline's one spare gradient, no buffer
    is made after start-up. With none, a stream that enters the next iteration before the
    merger is done with the last needs one made then (``GradientPool.fresh``: memory beyond
    the design's, which ``benchmarks.replay`` prints beside its peak): the result counts them,
    and the replica is right either way. (A round that holds several iterations, as one batch
    of a small capture does, needs a buffer for each: the merger runs after the round.)"""
    job = make_job(3, "Simple", 2, "fp32")
    simulate(tmp_path / "sim", job, iterations=3)
    monkeypatch.setattr(pipeline_module, "DEFAULT_SPARES", spares)
    result, _ = run_replay(job, streams_of(tmp_path / "sim", job), tmp_path / "replay", start_of(tmp_path / "sim"),
                           batch_frames=64)
    assert (result.late_buffers > 0) == (spares == 0) and all(r.recovered for r in result.reports)
    assert verify(tmp_path / "replay", tmp_path / "sim" / "truth", job_params(job)).ok


def test_a_replay_is_freed_with_its_results_without_waiting_for_the_collector(tmp_path):
    """The replica and the pipeline's gradients are gigabytes: once the replay's results are
    dropped, reference counting alone must free them. A reference cycle among them (the
    pipeline holding the numbering's callback, the numbering holding the pipeline) left them
    to the next full collection, which a process that makes few objects may not reach for
    many replays: ``benchmarks.replay``'s process grew by 2 GB per GPT-2 small replay until
    the kernel's OOM killer ended it."""
    job = make_job(3, "Simple", 2, "fp32")
    simulate(tmp_path / "sim", job, iterations=2)
    gc.collect()
    gc.disable()
    try:
        result, sink = run_replay(job, streams_of(tmp_path / "sim", job), tmp_path / "replay",
                                  start_of(tmp_path / "sim"), digests=False)
        assert all(r.recovered for r in result.reports)
        replica = weakref.ref(sink.replica)
        state = [weakref.ref(a) for a in (sink.replica.state.param, sink.replica.state.exp_avg)]
        del result, sink
        assert replica() is None, [type(r).__name__ for r in gc.get_referrers(replica())]
        assert all(a() is None for a in state)
    finally:
        gc.enable()


@pytest.mark.slow
def test_a_trainer_resumed_from_a_snapshot_continues_bit_for_bit(tmp_path):
    job = make_job(3, "LL", 2, "fp32")
    simulate(tmp_path / "sim", job, iterations=4)
    run_replay(job, streams_of(tmp_path / "sim", job), tmp_path / "replay", start_of(tmp_path / "sim"))
    snap = sorted((tmp_path / "replay" / "snapshots").glob("iteration-*"))[0]
    # The two lines a trainer runs (docs/store.md), into a real torch training loop.
    model_sd = torch.load(snap / "model.pt", weights_only=True)
    optim_sd = torch.load(snap / "optimizer.pt", weights_only=True)
    k = snapshot.verify(snap)["iteration"]
    assert k < 5
    trainer = resume(job, {"model": model_sd, "optimizer": optim_sd, "iteration": k}, seed=7, until=5)
    resumed = optimizer_arrays(trainer.model, trainer.optimizer)
    with np.load(tmp_path / "sim" / "truth" / "iter_000004" / "state.npz") as truth:
        for key in truth.files:
            assert resumed[key].tobytes() == truth[key].tobytes(), key


def allgather_frames(path: Path, job, ordinal: int, bucket: int) -> list[int]:
    """Indices, in the capture file ``path`` of a stream of ``job``, of the allgather frames of
    one bucket of one iteration (ordinal since the capture began), found by the tests' own
    decoder and the plan's PSN offsets."""
    plan = job_plan(job)
    ranks = {r.ip: i for i, r in enumerate(job.ring.ranks)}
    first = naive_coverage.first_psns(path, job, plan)
    batch = read_pcap(path)
    out = []
    for i, (o, c) in enumerate(zip(batch.offsets, batch.caplens)):
        f, _ = naive.decode_frame(bytes(batch.data[o:o + c]))
        if f is not None and 0x06 <= f["opcode"] <= 0x0B and f["ip_src"] in ranks and f["ip_dst"] in ranks:
            flow = naive_coverage._flow(plan, ranks[f["ip_src"]], ranks[f["ip_dst"]], f["dest_qp"])
            if flow is not None:
                it, pos = divmod((f["psn"] - first[flow]) % PSN_MODULUS, int(plan.flows["npkts"][flow]))
                msgs = plan.flow_messages(flow)
                w = msgs[np.searchsorted(msgs["psn_offset"], pos, side="right") - 1]
                if it == ordinal and w["phase"] == PHASE_AG and w["bucket"] == bucket:
                    out.append(i)
    return out


def drop_allgather(out: Path, job, ordinal: int, bucket: int) -> int:
    """Rewrite every stream's capture without the allgather frames of one bucket of one
    iteration (ordinal since the capture began), so that no stream covers those blocks."""
    dropped = 0
    for m in job.mirrors:
        path = out / "streams" / f"{m.name}.pcap"
        doomed = set(allgather_frames(path, job, ordinal, bucket))
        dropped += len(doomed)
        batch = read_pcap(path)
        keep = np.asarray([i for i in range(len(batch.offsets)) if i not in doomed], np.int64)
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
@pytest.mark.parametrize("given", ["in the process", "on the command line"])
def test_unrecoverable_iteration_falls_back_marks_stale_and_resync_restores_exactness(tmp_path, trainer_endpoint,
                                                                                       given):
    """The resync checkpoint given to ``run_replay`` (kept: the trainer's live state_dict), or
    to ``gradtap replay --resync`` as a file (loaded as the replica takes it, and handed over)."""
    url, received = trainer_endpoint
    job = make_job(3, "LL", 2, "fp32")
    job = job.model_copy(update={"appliance": job.appliance.model_copy(update={"control_endpoint": url})})
    simulate(tmp_path / "sim", job, iterations=5)
    assert drop_allgather(tmp_path / "sim", job, ordinal=2, bucket=0) > 0
    # The trainer's regular checkpoint after the lost iteration (3): what it sends when asked.
    checkpoint = resume(job, start_of(tmp_path / "sim"), seed=7, until=4).state_dict()
    if given == "in the process":
        _, sink = run_replay(job, streams_of(tmp_path / "sim", job), tmp_path / "replay", start_of(tmp_path / "sim"),
                             resync=[checkpoint])
        assert not sink.replica.stale
        assert all(len(v) for v in checkpoint["optimizer"]["state"].values())      # the trainer's, untouched
    else:
        from click.testing import CliRunner

        from gradtap.cli import _register, app
        _register()
        torch.save(checkpoint, tmp_path / "iter4.pt")
        (tmp_path / "job.yaml").write_text(dump_job(job))
        done = CliRunner().invoke(app, ["replay", str(tmp_path / "job.yaml"),
                                        *(f"{n}={p}" for n, p in streams_of(tmp_path / "sim", job).items()),
                                        "--out", str(tmp_path / "replay"), "--start",
                                        str(tmp_path / "sim" / "truth" / "start.pt"),
                                        "--resync", str(tmp_path / "iter4.pt")])
        assert done.exit_code == 0, done.output
        assert "replica current at iteration 6" in done.output
        # A file that is no checkpoint is refused before the replay touches --out.
        (tmp_path / "bad.pt").write_text("not a checkpoint")
        kept = (tmp_path / "replay" / "iterations.jsonl").read_text()
        bad = CliRunner().invoke(app, ["replay", str(tmp_path / "job.yaml"),
                                       *(f"{n}={p}" for n, p in streams_of(tmp_path / "sim", job).items()),
                                       "--out", str(tmp_path / "replay"), "--start",
                                       str(tmp_path / "sim" / "truth" / "start.pt"),
                                       "--resync", str(tmp_path / "bad.pt")])
        assert bad.exit_code != 0 and "not a torch.save archive" in str(bad.exception), bad.output
        assert (tmp_path / "replay" / "iterations.jsonl").read_text() == kept
        missing = CliRunner().invoke(app, ["replay", str(tmp_path / "job.yaml"), "x.pcap", "--out",
                                           str(tmp_path / "r2"), "--resync", str(tmp_path / "absent.pt")])
        assert missing.exit_code == 2 and "absent.pt' does not exist" in missing.output      # before any work
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


def test_stream_names_and_files_are_checked(tmp_path):
    job = make_job(2, "LL", 1, "fp32")
    (tmp_path / "m-egress.pcap").write_bytes(b"")
    with pytest.raises(ConfigError, match="not a mirror stream"):
        match_streams(job, [str(tmp_path / "other.pcap")])
    with pytest.raises(ConfigError, match="not a file"):
        match_streams(job, ["m-both=" + str(tmp_path / "missing.pcap")])
    assert match_streams(job, [str(tmp_path / "m-egress.pcap")]) == {"m-egress": tmp_path / "m-egress.pcap"}


# -- the majority rule, end to end -----------------------------------------------------------------

def ring_job(name: str, n: int, mirrors: list[tuple[str, int, str]], *, protocol: str = "Simple",
             grad_dtype: str = "fp32", predivide: bool = True, optimizer: dict | None = None):
    ranks = [{"ip": f"198.18.{i}.1", "mac": f"02:00:00:00:03:{i + 1:02x}"} for i in range(n)]
    return parse_job({
        "name": name, "model": {"factory": "gradtap.workload.models:mlp", "kwargs": {"sizes": [64, 96, 10]}},
        "ddp": {"bucket_cap_mb": 0.01, "grad_dtype": grad_dtype, "predivide": predivide},
        "optimizer": optimizer or {"kind": "adam", "lr": 1e-3},
        "nccl": {"protocol": protocol, "channels": 2, "mtu": 1024},
        "ring": {"ranks": ranks}, "training": {"batch_size": 4},
        "mirrors": [{"name": m, "rank": r, "direction": d} for m, r, d in mirrors],
    })


#: Egress of ring positions 0, 1 and 2 of a 4-rank ring: chunk 0 (missed only by position 3's
#: egress) travels on all three links, the others on two.
MAJORITY_MIRRORS = [("r0", 0, "egress"), ("r1", 1, "egress"), ("r2", 2, "egress")]
LIAR = "r1"


def carried_by_all(plan, job) -> np.ndarray:
    """bool[blocks]: the coverage blocks every mirror stream of ``job`` carries."""
    count = np.zeros(len(plan.blocks), np.int64)
    msgs = plan.messages
    for m in job.mirrors:
        ag = msgs[np.isin(msgs["flow"], plan.flows_of(m.rank, m.direction)) & (msgs["kind"] == DATA)
                  & (msgs["phase"] == PHASE_AG) & (msgs["block"] >= 0)]
        mine = np.zeros(len(plan.blocks), bool)
        for w in ag:
            mine[w["block"]:w["block"] + w["npkts"]] = True
        count += mine
    return count == len(job.mirrors)


def falsify_allgather(path: Path, job, plan, blocks: np.ndarray) -> dict[int, set[int]]:
    """Rewrite one capture so that its allgather packets of ``blocks`` (every other one, in
    every iteration) carry wrong gradient bytes -- the lowest mantissa bit of every fp32 word
    flipped -- under a recomputed, valid ICRC: a lie only a comparison with other streams can
    see. Frames whose ICRC was already bad (a training-link fault) are left alone.
    Returns, per iteration ordinal, the blocks falsified."""
    ranks = {r.ip: i for i, r in enumerate(job.ring.ranks)}
    first = naive_coverage.first_psns(path, job, plan)
    batch = read_pcap(path)
    data = batch.data.copy()
    lies: dict[int, set[int]] = {}
    for o, c in zip(batch.offsets, batch.caplens):
        frame = bytes(data[o:o + c])
        f, _ = naive.decode_frame(frame)
        if f is None or not f["icrc_ok"] or not 0x06 <= f["opcode"] <= 0x0B:
            continue
        if f["ip_src"] not in ranks or f["ip_dst"] not in ranks:
            continue
        flow = naive_coverage._flow(plan, ranks[f["ip_src"]], ranks[f["ip_dst"]], f["dest_qp"])
        if flow is None:
            continue
        it, pos = divmod((f["psn"] - first[flow]) % PSN_MODULUS, int(plan.flows["npkts"][flow]))
        msgs = plan.flow_messages(flow)
        w = msgs[np.searchsorted(msgs["psn_offset"], pos, side="right") - 1]
        if w["phase"] != PHASE_AG or w["block"] < 0:
            continue
        block = int(w["block"]) + pos - int(w["psn_offset"])      # Simple: one block per packet
        if not blocks[block] or block % 2:
            continue
        end = f["l4_start"] + int.from_bytes(frame[f["l4_start"] + 4:f["l4_start"] + 6], "big")
        stop = end - 4 - f["padcnt"]
        start = stop - len(f["payload"])
        assert len(f["payload"]) % 4 == 0
        data[o + start:o + stop:4] ^= 1                            # little-endian fp32: the lowest bit
        data[o + end - 4:o + end] = np.frombuffer(compute_icrc(bytes(data[o:o + c])).to_bytes(4, "little"),
                                                  np.uint8)
        lie, _ = naive.decode_frame(bytes(data[o:o + c]))
        assert lie["icrc_ok"] and lie["payload"] != f["payload"]   # checked by the independent decoder
        lies.setdefault(it, set()).add(block)
    with PcapWriter(path) as out:
        out.write_batch(FrameBatch(data, batch.offsets, batch.caplens, batch.wirelens, batch.ts_ns, batch.linktype))
    return lies


@pytest.fixture(scope="module")
def lying_stream(tmp_path_factory):
    """Four iterations of a 4-rank job, mirrored on three links; one stream lies about chunk 0.
    The job clips, so the replica keeps the merged buckets until the step (``lasting``): a
    bucket merged from several copies must not be overwritten before then."""
    out = tmp_path_factory.mktemp("majority")
    job = ring_job("majority", 4, MAJORITY_MIRRORS,
                   optimizer={"kind": "adamw", "lr": 1e-3, "weight_decay": 0.01, "clip_grad_norm": 0.05})
    # Two buckets, so that an iteration hands more than one bucket merged from several copies.
    names = [p.name for p in job_params(job)]
    job = job.model_copy(update={"ddp": job.ddp.model_copy(update={
        "layout": "explicit", "buckets": (tuple(names[2:]), tuple(names[:2]))})})
    plan = job_plan(job)
    everyone = carried_by_all(plan, job)
    assert 0 < everyone.sum() < len(everyone)
    # Training-link loss and corruption (resent by the sender), but no mirror loss: a block one
    # honest stream lost would leave one honest copy against one lie, a tie.
    Simulation(job, out / "sim", iterations=4, seed=11,
               faults=parse_faults("link_loss=2e-3,corrupt=2e-3", tuple(m.name for m in job.mirrors))).run()
    lies = falsify_allgather(out / "sim" / "streams" / f"{LIAR}.pcap", job, plan, everyone)
    assert sorted(lies) == [0, 1, 2, 3] and all(lies.values())
    return job, out, lies


@pytest.mark.slow
@pytest.mark.parametrize("position", [0, 1, 2])
def test_the_majority_outvotes_a_stream_with_wrong_bytes_and_a_valid_icrc(lying_stream, position, tmp_path):
    """Whatever the liar's position among the streams -- first, where a "first stream wins"
    merge takes its bytes, or later -- the replica is the trainer's, bit for bit, and every
    lie is reported as a duplicate mismatch that the two honest streams won."""
    job, out, lies = lying_stream
    honest = [m.name for m in job.mirrors if m.name != LIAR]
    order = honest[:position] + [LIAR] + honest[position:]
    pcaps = {name: out / "sim" / "streams" / f"{name}.pcap" for name in order}
    assert list(pcaps)[position] == LIAR
    start = start_of(out / "sim")
    first = start["iteration"]            # the trainer's iteration of the capture's first
    _, sink = run_replay(job, pcaps, tmp_path / "replay", start)
    v = verify(tmp_path / "replay", out / "sim" / "truth", job_params(job))
    assert v.ok and not v.stale and v.digests_checked == [first + k for k in range(4)], v
    assert not sink.replica.stale
    events = [json.loads(line) for line in (tmp_path / "replay" / "events.jsonl").read_text().splitlines()]
    mismatches = [e for e in events if e["event"] == "duplicate_mismatch"]
    assert [e["iteration"] for e in mismatches] == [first + k for k in range(4)]
    for e in mismatches:
        assert {b["block"] for b in e["blocks"]} == lies[e["iteration"] - first]
        for b in e["blocks"]:
            assert b["resolved"] and [sorted(g) for g in b["groups"]] == [sorted(honest), [LIAR]], b


@pytest.mark.slow
@pytest.mark.parametrize("liar_first", [True, False])
def test_the_majority_outvotes_a_liar_that_claimed_the_shared_gradient_first(lying_stream, liar_first):
    """The streams share one gradient per iteration: whichever parser claims a unit first
    writes it. Here the liar's parser places its whole capture before the honest ones start
    (every lie is the shared copy, the honest copies are kept aside) or after them (the lies
    are kept aside); the merged gradient is the truth either way, and each lie is a
    mismatch the two honest streams won."""
    job, out, lies = lying_stream
    plan = job_plan(job)
    honest = [m.name for m in job.mirrors if m.name != LIAR]
    order = [LIAR, *honest] if liar_first else [*honest, LIAR]
    pool = GradientPool(plan.grad_bytes, len(plan.blocks), 8)
    # A window as long as the capture: no stream retires an iteration before the last has placed it.
    parsers = {name: StreamParser(job, plan, name, slots=8, spares=0, pool=pool) for name in order}
    for name in order:
        assert parsers[name].feed(read_pcap(out / "sim" / "streams" / f"{name}.pcap")) == []
    set_aside = {name: int(p.counters[ev.DATA_SET_ASIDE]) for name, p in parsers.items()}
    assert set_aside[LIAR] == (0 if liar_first else sum(map(len, lies.values())))
    assert all(set_aside[h] == (sum(map(len, lies.values())) if liar_first else 0) for h in honest)
    sink = Collect()
    first = start_of(out / "sim")["iteration"]
    merger = Merger(plan, order, sink, first_iteration=first)
    for name, p in parsers.items():
        merger.update(name, p.flush(), [])
    reports = merger.close()
    assert sink.done == [first + k for k in range(4)]
    for it in sink.done:
        truth = np.load(iteration_dir(out / "sim" / "truth", it) / "grad.npy").view(np.uint8)
        merged = b"".join(sink.buckets[it][b] for b in range(len(plan.bucket_numels)))
        assert merged == truth.tobytes(), f"iteration {it} differs from the truth"
    for r in reports:
        assert {m.block for m in r.mismatches} == lies[r.iteration - first]
        assert all(m.resolved and [sorted(g) for g in m.groups] == [sorted(honest), [LIAR]] for m in r.mismatches)


# -- predivide: false ---------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("grad_dtype", ["fp32", "bf16"])
def test_summed_gradients_without_predivide_replay_bit_exactly(tmp_path, grad_dtype):
    """DDP with ``predivide: false`` puts the plain sum of the ranks' gradients on the wire; the
    replica divides by the world size itself. AdamW with weight decay and gradient clipping
    makes the scale matter (Adam alone is almost scale-invariant)."""
    optimizer = {"kind": "adamw", "lr": 1e-3, "weight_decay": 0.01, "clip_grad_norm": 0.05}
    job = ring_job("summed", 3, [("m-egress", 0, "egress"), ("m-ingress", 1, "ingress"), ("m-both", 2, "both")],
                   protocol="LL", grad_dtype=grad_dtype, predivide=False, optimizer=optimizer)
    assert job.ddp.predivide is False
    Simulation(job, tmp_path / "sim", iterations=3, seed=3,
               faults=parse_faults(FAULTS, tuple(m.name for m in job.mirrors))).run()
    truth = tmp_path / "sim" / "truth"
    run_replay(job, streams_of(tmp_path / "sim", job), tmp_path / "replay", start_of(tmp_path / "sim"))
    v = verify(tmp_path / "replay", truth, job_params(job))
    assert v.ok and not v.stale and v.digests_checked == [1, 2, 3] and v.snapshots_checked, v

    # The last snapshot, tensor by tensor, against the trainer's state (independently of verify).
    snap = sorted((tmp_path / "replay" / "snapshots").glob("iteration-*"))[-1]
    k = snapshot.verify(snap)["iteration"]
    model_sd = torch.load(snap / "model.pt", weights_only=True)
    optim_sd = torch.load(snap / "optimizer.pt", weights_only=True)
    with np.load(truth / f"iter_{k - 1:06d}" / "state.npz") as state:
        for i, p in enumerate(job_params(job)):
            assert model_sd[p.name].numpy().tobytes() == state[f"param/{p.name}"].tobytes(), p.name
            assert optim_sd["state"][i]["exp_avg_sq"].numpy().tobytes() == state[f"exp_avg_sq/{p.name}"].tobytes()

    # The same capture replayed as if DDP had pre-divided is not the trainer: the flag is load-bearing.
    wrong = job.model_copy(update={"ddp": job.ddp.model_copy(update={"predivide": True})})
    run_replay(wrong, streams_of(tmp_path / "sim", job), tmp_path / "wrong", start_of(tmp_path / "sim"))
    assert verify(tmp_path / "wrong", truth, job_params(job)).differences


def test_the_benchmarks_disagreeing_capture_flips_one_payload_bit_in_n_frames(tmp_path):
    """``benchmarks.replay --disagree N``'s capture: the first stream's bytes differ from the
    simulated ones in exactly N frames, by one bit of the payload each, which the independent
    decoder sees as a bad ICRC; the other streams and the truth are the simulated ones."""
    job = make_job(3, "Simple", 2, "fp32", mtu=1024)
    simulate(tmp_path / "sim", job, iterations=1)
    out = flipped_capture(tmp_path / "sim", job, 7)
    assert flipped_capture(tmp_path / "sim", job, 7) == out, "made once"
    first = job.mirrors[0].name
    before, after = (read_pcap(d / "streams" / f"{first}.pcap") for d in (tmp_path / "sim", out))
    assert np.array_equal(before.offsets, after.offsets) and np.array_equal(before.ts_ns, after.ts_ns)
    diff = np.flatnonzero(before.data != after.data)
    assert len(diff) == 7 and all(bin(int(before.data[i] ^ after.data[i])).count("1") == 1 for i in diff)
    frames = np.searchsorted(before.offsets, diff, side="right") - 1
    assert (diff - before.offsets[frames] == FLIPPED_BYTE).all() and (before.caplens[frames] > 1000).all()
    for i in frames:
        o, c = int(after.offsets[i]), int(after.caplens[i])
        f, _ = naive.decode_frame(bytes(after.data[o:o + c]))
        assert f is not None and not f["icrc_ok"]
    for m in job.mirrors[1:]:
        assert (out / "streams" / f"{m.name}.pcap").resolve() == (tmp_path / "sim" / "streams" / f"{m.name}.pcap")
    assert (out / "truth").resolve() == tmp_path / "sim" / "truth"


GAP = 1_000


@pytest.mark.parametrize("stamps, until, quiet", [
    # Every stream pauses after 300 (and again after 5000): the round ends at the first pause.
    ([[100, 200, 300, 2000, 2100], [150, 250, 1900, 2050, 5000, 7000]], 6000, 300),
    # One stream's pause alone is no boundary: the other carries frames through it.
    ([[100, 200, 1500, 1600], [100, 500, 900, 1300, 1700]], 1600, None),
    # The streams pause at different frames; the later pause start is where all are quiet.
    ([[100, 400, 1800], [100, 500, 650, 1700]], 1700, 650),
    # A pause that reaches past the horizon is not known yet to end later than it.
    ([[100, 200, 1500], [100, 200, 1100]], 1100, None),
    # A pause exactly as long as the gap counts; one a nanosecond shorter does not.
    ([[0, 10, 1010], [5, 1010]], 1010, 10),
    ([[0, 10, 1009], [5, 1009]], 1009, None),
    # A stream with no frame before the pause ends is quiet through it.
    ([[100, 200, 1300], [1250, 1260]], 1260, 200),
])
def test_a_round_ends_where_every_stream_pauses_for_the_iteration_gap(stamps, until, quiet):
    assert quiet_from([np.array(s, np.int64) for s in stamps], until, GAP) == quiet


def test_an_iteration_is_applied_before_any_frame_after_its_pause_is_parsed(tmp_path, monkeypatch):
    """The round that carries an iteration's last frames ends at the pause after them (the
    capture's clock at the pause's end), so the merger finishes it and the sink applies it
    before any stream places a frame of the next iteration; with a round cut by the batches
    alone, the next iteration's first frames came in the same round."""
    job = make_job(3, "Simple", 2, "fp32")
    simulate(tmp_path / "sim", job, iterations=4)
    pipelines = []

    class Watched(pipeline_module.Pipeline):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pipelines.append(self)

    class Ahead(Collect):
        """Per iteration done: the later iterations some stream had placed frames of by then."""

        def __init__(self):
            super().__init__()
            self.ahead: dict[int, set[int]] = {}

        def iteration_done(self, iteration, report):
            super().iteration_done(iteration, report)
            p = pipelines[0]
            self.ahead[iteration] = {p.merger.first + i for parser in p.parsers.values()
                                     for i, n in parser.placed().items() if n and p.merger.first + i > iteration}

    monkeypatch.setattr("gradtap.replay.Pipeline", Watched)
    sink = Ahead()
    result = replay(job, job_plan(job), streams_of(tmp_path / "sim", job), sink, batch_frames=1 << 14)
    assert sink.done == [0, 1, 2, 3] and all(r.recovered for r in result.reports)
    assert sink.ahead == {it: set() for it in sink.done}
