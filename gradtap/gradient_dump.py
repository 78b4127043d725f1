"""``gradtap replay --gradients DIR``: what the appliance saw, for comparison with the trainer.

A sink in front of the replica's (:class:`GradientDump`) keeps each merged bucket of an
iteration and, once the iteration is recovered, writes its reduced gradient as one flat
array in wire order (buckets concatenated in launch order, in the wire dtype; bf16 and fp16
as their uint16 bit patterns), ``DIR/iter_NNNNNN.npy``, numbered by the trainer's iteration,
with ``DIR/layout.json`` beside it: the format of the simulator's ``truth/iter_NNNNNN/grad.npy``
and ``truth/layout.json``. An unrecoverable iteration writes nothing (no partial gradient).
Each file is written to a temporary name and renamed, so a file there is whole.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from gradtap.merger.merger import IterationReport, Sink
from gradtap.updater.replica import WIRE_NUMPY
from gradtap.workload.layout import job_buckets, job_params, layout_document
from gradtap.workload.spec import JobSpec


class GradientDump:
    """Passes everything on to ``sink`` and writes each recovered iteration's gradient to ``directory``."""

    def __init__(self, sink: Sink, directory: Path, job: JobSpec):
        self.sink, self.directory = sink, Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.dtype = WIRE_NUMPY[job.ddp.grad_dtype]
        buckets = job_buckets(job)
        elem = self.dtype.itemsize
        self.offsets = np.concatenate([[0], np.cumsum([b.numel * elem for b in buckets])]).tolist()
        # One buffer for every iteration: a recovered one had every bucket handed, so every
        # byte written is its own.
        self._grad = np.zeros(self.offsets[-1], np.uint8)
        self._open: int | None = None         # the iteration whose buckets the buffer holds
        self.written: list[int] = []
        self._layout = (job_params(job), buckets, job.ddp.grad_dtype)

    def bucket(self, iteration: int, bucket: int, data: np.ndarray) -> None:
        self._open = iteration
        raw = data.view(np.uint8).reshape(-1)
        self._grad[self.offsets[bucket]:self.offsets[bucket] + raw.size] = raw
        self.sink.bucket(iteration, bucket, data)

    def iteration_done(self, iteration: int, report: IterationReport) -> None:
        held, self._open = self._open == iteration, None
        if report.recovered and held:
            if not self.written:
                params, buckets, dtype = self._layout
                self._write_text("layout.json", json.dumps(layout_document(params, buckets, dtype, iteration),
                                                           indent=1))
            self._write_array(f"iter_{iteration:06d}.npy", self._grad.view(self.dtype))
            self.written.append(iteration)
        self.sink.iteration_done(iteration, report)

    def _write_text(self, name: str, text: str) -> None:
        tmp = self.directory / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.directory / name)

    def _write_array(self, name: str, array: np.ndarray) -> None:
        tmp = self.directory / f".{name}.tmp"
        with tmp.open("wb") as f:
            np.save(f, array)
        os.replace(tmp, self.directory / name)
