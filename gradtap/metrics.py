"""Prometheus metrics of a running appliance, read from its live state at each scrape.

Served by the standard client library on ``--metrics-port`` (localhost by default). Every
metric is computed from the appliance's own counters when scraped, so nothing is counted
twice and nothing can drift:

- ``gradtap_frames_total{stream}``, ``gradtap_bytes_total{stream}``: frames and bytes captured;
- ``gradtap_drops_total{stream,reason}``: ``kernel`` (the socket), ``ring`` (ring full),
  ``truncated`` (longer than a ring slot);
- ``gradtap_decode_events_total{stream,event}``: the parser's events (``wire/events.py``);
- ``gradtap_iterations_total{result}``: ``recovered`` / ``unrecoverable`` / ``skipped`` (captured
  before the replica's start: ``gradtap/start.py``);
- ``gradtap_replica_iteration``, ``gradtap_replica_stale``, ``gradtap_replica_lag_seconds``,
  ``gradtap_replica_numbered`` (0 while waiting for the trainer's checkpoint with ``time_ns``);
- ``gradtap_stage_seconds_total{stage}``: time spent parsing, merging, updating;
- ``gradtap_cpu_seconds_total{process,stream}``: CPU time, user and system, of each stream's
  capture worker (``process="capture"``) and of the appliance's own process
  (``process="appliance"``, ``stream=""``: parsers, merger, updater). Over
  ``gradtap_frames_total`` it gives the core-seconds a node spends per frame, what sizes it
  (``rate(gradtap_cpu_seconds_total[5m]) / ignoring(process) rate(gradtap_frames_total[5m])``
  per stream for the capture, over their sum for the appliance);
- ``gradtap_update_backlog``: calls the update thread has queued and not yet made (buckets and
  iterations' ends); absent where the updater runs between rounds (``gradtap/update_thread.py``);
- ``gradtap_gradients_made_late_total``: iterations' shared gradients made after start-up, each
  the size of the model's gradient while it serves: the updater was behind the parsers, or one
  stream far behind the others (``parser/shared_gradient.py``);
- ``gradtap_attestations_total{result}``: the trainer's fingerprints the replica ``matched``, and
  those that were a ``mismatch`` (each an ``integrity.mismatch`` event: ``gradtap/attestation.py``);
- ``gradtap_snapshots_total{result}``: local snapshots ``written``, ``skipped`` (due while the
  background writer was still busy with the one before: ``appliance.snapshot_buffers``) and
  ``failed`` (``store/snapshot.py``);
- ``gradtap_store_snapshots_total{result}``: snapshots the durable tier ``uploaded``, ``skipped``
  (replaced by a newer one while the store was slow) and upload attempts that ``failed``
  (``store/uploader.py``); absent without a store.
- ``gradtap_gradient_log_records_total{result}``: iterations the gradient log ``logged``,
  ``dropped`` (gaps: its buffers were full) and write attempts that ``failed``
  (``store/gradient_log.py``); absent without a log;
- a mirror-group node (``docs/group.md``): ``gradtap_group_bytes_total{direction}`` (``sent`` to
  and ``received`` from its peers, lengths included), ``gradtap_group_peer_up{peer}`` (0 once
  the peer is gone: see the ``group.peer_gone`` event), ``gradtap_group_rank`` and
  ``gradtap_group_world_size``; absent outside a group.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gradtap.status import ApplianceStatus


class ApplianceCollector:
    """Turns ``status()`` (:meth:`gradtap.appliance.Appliance.status`) into metric families."""

    def __init__(self, status: Callable[[], ApplianceStatus]):
        self.status = status

    def collect(self):
        s = self.status()
        frames = CounterMetricFamily("gradtap_frames", "frames captured", labels=["stream"])
        nbytes = CounterMetricFamily("gradtap_bytes", "bytes captured", labels=["stream"])
        drops = CounterMetricFamily("gradtap_drops", "frames lost before parsing", labels=["stream", "reason"])
        events = CounterMetricFamily("gradtap_decode_events", "frames by decode event", labels=["stream", "event"])
        cpu = CounterMetricFamily("gradtap_cpu_seconds", "CPU time, user and system, of the capture workers and "
                                  "of the appliance's process", labels=["process", "stream"])
        for stream, c in s.capture.items():
            frames.add_metric([stream], c.get("frames", 0))
            nbytes.add_metric([stream], c.get("bytes", 0))
            for reason, key in (("kernel", "kernel_drops"), ("ring", "ring_drops"), ("truncated", "truncated")):
                drops.add_metric([stream, reason], c.get(key, 0))
            if "cpu_us" in c:
                cpu.add_metric(["capture", stream], c["cpu_us"] / 1e6)
        cpu.add_metric(["appliance", ""], s.cpu_s)
        for stream, counters in s.events.items():
            for event, n in counters.items():
                events.add_metric([stream, event], n)
        iterations = CounterMetricFamily("gradtap_iterations", "merged iterations", labels=["result"])
        iterations.add_metric(["recovered"], s.recovered)
        iterations.add_metric(["unrecoverable"], s.unrecoverable)
        iterations.add_metric(["skipped"], s.skipped)
        stages = CounterMetricFamily("gradtap_stage_seconds", "time per pipeline stage", labels=["stage"])
        for stage, seconds in (("parse", s.parse_s), ("merge", s.merge_s), ("update", s.update_s)):
            stages.add_metric([stage], seconds)
        attestations = CounterMetricFamily("gradtap_attestations", "the trainer's fingerprints checked",
                                           labels=["result"])
        attestations.add_metric(["matched"], s.attested)
        attestations.add_metric(["mismatch"], s.diverged)
        late = CounterMetricFamily("gradtap_gradients_made_late", "iterations' shared gradients made after "
                                   "start-up (the updater was behind, or a stream far behind the others)")
        late.add_metric([], s.gradients_made_late)
        yield from (frames, nbytes, drops, events, iterations, stages, cpu, attestations, late)
        for name, doc, counts, results in (
                ("gradtap_snapshots", "local snapshots of the replica", s.snapshots, ("written", "skipped", "failed")),
                ("gradtap_store_snapshots", "snapshots sent to the durable store", s.store,
                 ("uploaded", "skipped", "failed")),
                ("gradtap_gradient_log_records", "iterations' gradients for the store's log", s.gradient_log,
                 ("logged", "dropped", "failed"))):
            if counts is not None:
                family = CounterMetricFamily(name, doc, labels=["result"])
                for result in results:
                    family.add_metric([result], counts[result])
                yield family
        if s.group is not None:
            yield from _group_metrics(s.group)
        locked = GaugeMetricFamily("gradtap_stream_locked", "1 once the stream has locked on to the job's "
                                   "traffic (0: see the lockon.failed event)", labels=["stream"])
        for stream, yes in s.locked.items():
            locked.add_metric([stream], int(yes))
        yield locked
        yield GaugeMetricFamily("gradtap_replica_iteration", "next iteration the replica expects",
                                value=s.replica_iteration)
        yield GaugeMetricFamily("gradtap_replica_stale", "1 while the replica waits for a resync",
                                value=int(s.stale))
        yield GaugeMetricFamily("gradtap_replica_lag_seconds", "last iteration: its last frame to the update",
                                value=s.lag_s)
        if s.update_backlog is not None:
            yield GaugeMetricFamily("gradtap_update_backlog", "calls the update thread has queued and not yet made "
                                    "(buckets, iterations' ends)", value=s.update_backlog)
        yield GaugeMetricFamily("gradtap_replica_numbered", "0 while it is not known which captured iteration is "
                                "which (waiting for the trainer's checkpoint with time_ns)", value=int(s.numbered))


def _group_metrics(group: dict):
    """The mirror group's families from ``ApplianceStatus.group``."""
    exchanged = CounterMetricFamily("gradtap_group_bytes", "bytes exchanged with the mirror group's peers",
                                    labels=["direction"])
    exchanged.add_metric(["sent"], group["sent_bytes"])
    exchanged.add_metric(["received"], group["received_bytes"])
    up = GaugeMetricFamily("gradtap_group_peer_up", "1 while the peer takes part in the group's rounds (0: see "
                           "the group.peer_gone event)", labels=["peer"])
    for peer, state in group["peers"].items():
        up.add_metric([peer], int(state == "up"))
    yield exchanged
    yield up
    yield GaugeMetricFamily("gradtap_group_rank", "this node's rank in its mirror group", value=group["rank"])
    yield GaugeMetricFamily("gradtap_group_world_size", "the mirror group's CPU nodes", value=group["world_size"])


def serve(status: Callable[[], ApplianceStatus], port: int, address: str = "127.0.0.1") -> CollectorRegistry:
    """Start the metrics HTTP server (a daemon thread) on ``address:port`` and return its registry."""
    registry = CollectorRegistry()
    registry.register(ApplianceCollector(status))
    start_http_server(port, addr=address, registry=registry)
    return registry
