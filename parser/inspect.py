"""What a capture holds, for ``gradtap inspect``: its RoCEv2 flows with their opcodes, payload
bytes, PSNs, PSN gaps and NCCL protocol, the ICRC results, and with a job, which messages are
which phase and bucket of the wire plan.

The file is read in :class:`~capture.pcap.PcapReader` batches and each batch is decoded by
stage 1 (``parser/decode.py``), so memory stays bounded whatever the file size or the number
of flows: per flow the summary keeps a few words in tables sized to what they hold
(``parser/inspect_flows.py``), and past ``max_flows`` flows further flows are counted (flows
and frames, ``"not_tracked"``) but not tracked. With a job, the mapping onto its wire plan is
``parser/inspect_job.py``'s (the stream parser's flow learning, then a second pass that counts).

Definitions (the JSON keys of :func:`inspect_capture`):

- **RoCEv2 frame**: a frame whose BTH was read (:func:`gradtap.parser.decode.is_roce`), whatever its
  opcode (0xaa counts), its ICRC or whether it was cut short; tshark counts the same frames.
- **flow**: (IP version, source IP, destination IP, BTH destination QP), in order of first
  appearance; the first ``max_flows`` are listed, the others only counted (``"not_tracked"``:
  ``flows``, ``frames``, ``flows_exact``, ``limit``). ``udp_sport`` is the source port of the
  flow's first frame (a flow may see several). ``payload_bytes`` is what follows the BTH and
  the opcode's extension headers, without pad and ICRC, as the UDP length declares it (for an
  unknown opcode, everything after the BTH). ``psn_first``/``psn_last`` are the PSNs of its first and last frame.
- **PSN gaps**: over the flow's requests (SEND, WRITE, READ request, ATOMIC; responses such
  as ACKs carry the responder's PSNs and are left out) without a bad ICRC, the number of
  places where a PSN skips forward from the highest PSN seen so far by more than one (modulo 2^24, forward
  meaning less than 2^23 ahead). A PSN at or behind the highest (a retransmission, a
  duplicate, a reordered packet) is not a gap. A READ request that is answered by several
  packets advances the PSN by more than one and so also shows as a gap.
- **ICRC**: ``ok``/``bad`` count the complete RoCEv2 frames whose ICRC was checked; a frame
  cut short is in neither.
- **NCCL protocol**, guessed from up to :data:`~parser.inspect_flows.MAX_SAMPLES` WRITE/SEND
  packets per flow with at least one LL128 line of payload and a good ICRC: ``LL`` if in every sampled packet each
  16-byte line has two equal 32-bit flags (bytes 4-7 and 12-15) and every line's flag is the
  packet's one nonzero flag; ``LL128`` if in every sampled packet the last 8 bytes of each
  128-byte line hold the packet's one flag, nonzero and below 2^32 (a step counter);
  ``Simple`` otherwise; ``unknown`` for a flow without such packets (ACK-only flows, CTS
  writes of 32 bytes).
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np

from gradtap.capture.pcap import PcapReader
from gradtap.core.errors import CaptureError, ConfigError
from gradtap.parser.decode import decode_batch
from gradtap.parser.inspect_flows import FlowTable
from gradtap.parser.inspect_job import PHASE_NAMES, JobCounter, JobLearner
from gradtap.wire.frame_record import FRAME_DTYPE, ICRC_BAD, ICRC_OK
from gradtap.workload.layout import job_plan

__all__ = ["DEFAULT_MAX_FLOWS", "PHASE_NAMES", "inspect_capture"]   # PHASE_NAMES: the CLI's column order

DEFAULT_MAX_FLOWS = 65536


def inspect_capture(path, job=None, progress: Callable[[int, int], None] | None = None,
                    max_frames: int = 65536, max_flows: int = DEFAULT_MAX_FLOWS,
                    stream: str | None = None) -> dict:
    """Summarise the capture at ``path`` (pcap or pcapng).

    Parameters
    ----------
    job:
        Optional :class:`~workload.spec.JobSpec`: also tell which flows are which of the job's
        planned flows and map their RDMA WRITE messages onto its wire plan
        (``parser/inspect_job.py``); adds the ``"job"`` key, and a ``"job"`` entry to each
        tracked flow between two of the job's ranks. The file is then read twice.
    progress:
        Called as ``progress(bytes_read, file_bytes)`` after each batch (``file_bytes`` is
        twice the file's size with a job: two passes).
    max_frames:
        Frames per batch (bounds memory: about 100 bytes of record per frame plus the
        batch's frames).
    max_flows:
        Flows tracked one by one (>= 1). Further flows are counted in ``"not_tracked"``
        (``flows``, ``frames``; ``flows_exact`` is false past 4M such flows, where ``flows``
        becomes a lower bound), not listed, and never the job's. Memory: about 200 bytes per
        tracked flow plus 16 per flow not tracked.
    stream:
        With a job, the name of its mirror stream the capture is; by default the one whose
        flows the capture shows (see ``parser/inspect_job.py``).

    Returns the JSON-ready dict described in the module docstring. Raises
    :class:`CaptureError` naming the file if it cannot be read as an Ethernet capture, and
    :class:`ConfigError` for a ``max_flows`` below 1 or a ``stream`` not in the job.
    """
    if isinstance(max_flows, bool) or not isinstance(max_flows, int) or max_flows < 1:
        raise ConfigError(f"max_flows: {max_flows!r} is not a positive number of flows; give at least 1 "
                          f"(default {DEFAULT_MAX_FLOWS})")
    if stream is not None and job is None:
        raise ConfigError(f"stream: {stream!r} names a mirror stream of a job, but no job was given; "
                          "give the job too, or leave the stream out")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CaptureError(f"{path}: no such capture file")
    total = os.path.getsize(path) * (2 if job is not None else 1)
    plan = job_plan(job) if job is not None else None
    learner = JobLearner(job, plan, stream) if job is not None else None
    flows = FlowTable(max_flows)
    frames = roce = icrc_ok = icrc_bad = 0
    records = np.empty(max_frames, FRAME_DTYPE)
    with PcapReader(path, max_frames=max_frames) as reader:
        for batch in reader:
            recs, _ = decode_batch(batch, out=records, decapsulate=True)   # ERSPAN opened, as tshark does
            ids = flows.assign(recs)
            flows.accumulate(recs, ids, batch.data)
            frames += len(recs)
            roce += int((ids != -1).sum())
            icrc_ok += int((recs["icrc"] == ICRC_OK).sum())
            icrc_bad += int((recs["icrc"] == ICRC_BAD).sum())
            if learner is not None:
                learner.observe(recs, batch.data, ids)
            if progress is not None:
                progress(reader.bytes, total)
        fmt = reader.format
    summary = {"file": path, "format": fmt, "frames": frames, "roce_frames": roce,
               "icrc": {"ok": icrc_ok, "bad": icrc_bad}, "flows": flows.describe(), "not_tracked": flows.untracked}
    if learner is not None:
        counter = JobCounter(job, plan, learner.finish(), flows)
        done = total // 2
        with PcapReader(path, max_frames=max_frames) as reader:
            for batch in reader:
                recs, _ = decode_batch(batch, out=records, decapsulate=True)
                counter.feed(recs, flows.assign(recs, insert=False))
                if progress is not None:
                    progress(done + reader.bytes, total)
        per_flow, summary["job"] = counter.finish()
        for f, info in per_flow.items():
            summary["flows"][f]["job"] = info
    return summary
