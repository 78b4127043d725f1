"""``gradtap demo``: the whole idea, end to end, on a small job, in a few seconds.

1. **Simulate** training of the shipped small job (4 data-parallel ranks, a 1M-parameter
   MLP, AdamW with warm-up and clipping) and the RoCEv2 traffic its ring allreduce puts on
   the wire, mirrored to 3 capture files with a realistic mix of faults.
2. **Replay** the captures through the appliance: parse, merge, update a replica.
3. **Verify** the replica against the trainer's true state after every iteration.
4. **Resume**: a trainer loads the replica's oldest snapshot with two standard PyTorch
   calls, trains on, and must end exactly where the uninterrupted trainer ended.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.panel import Panel

from gradtap.configs import shipped
from gradtap.progress import replay_progress, simulation_progress
from gradtap.replay import ReplayResult, run_replay
from gradtap.replica_sink import ReplicaSink
from gradtap.simulator.faults import parse_faults
from gradtap.simulator.run import Simulation, resume
from gradtap.simulator.truth import iteration_dir, optimizer_arrays
from gradtap.tables import events_table, iteration_table, summary_table, verification_lines
from gradtap.store import snapshot
from gradtap.verify import compare_state, verify
from gradtap.workload.layout import job_params
from gradtap.workload.spec import JobSpec, load_job

CONFIG = "small.yaml"
FAULTS = "mirror_loss=2e-3,link_loss=1e-3,corrupt=5e-4,reorder=1e-3,duplicate=1e-3,truncate=2e-4"


def run_demo(out: Path, iterations: int, seed: int, console: Console, *, plot: bool) -> bool:
    """The four steps into ``out/sim`` and ``out/replay`` (replaced if present), reported on
    ``console``; with ``plot``, also ``out/replay/iterations.png``. Whether all went right."""
    for mine in ("sim", "replay"):
        shutil.rmtree(out / mine, ignore_errors=True)
    console.print(Panel.fit(
        "gradtap rebuilds a training job's checkpoint from a switch mirror of its NCCL allreduce traffic. "
        f"This demo simulates a small job, mirrors 3 ports with faults ({FAULTS}), replays the captures "
        "through the appliance and checks the result.", title="gradtap demo"))

    console.rule("1. simulate: real PyTorch training, NCCL-faithful RoCEv2 traffic")
    job = load_job(shipped(CONFIG))
    faults = parse_faults(FAULTS, tuple(m.name for m in job.mirrors))
    with simulation_progress(console, iterations) as progress:
        sim = Simulation(job, out / "sim", iterations=iterations, seed=seed, faults=faults).run(progress)
    console.print(summary_table(sim))
    truth = out / "sim" / "truth"

    console.rule("2. replay: parse, merge and update a replica from the captures")
    streams = {s.name: s.path for s in sim.streams}
    start = torch.load(truth / "start.pt", weights_only=True)
    with replay_progress(console, streams) as progress:
        # Small batches, so the pipeline streams through the captures as it would live.
        result, sink = run_replay(job, streams, out / "replay", start, batch_frames=2048, progress=progress)
    console.print(iteration_table(result, sink))
    console.print(events_table(result))

    console.rule("3. verify: the replica against the trainer, bit for bit")
    v = verify(out / "replay", truth, job_params(job))
    for line in verification_lines(v):
        console.print(line)

    console.rule("4. resume: a trainer restarts from the replica's oldest snapshot")
    resumed_ok, resume_line = resume_from_oldest(job, out / "replay" / "snapshots", truth, seed, sim.iterations[-1] + 1)
    console.print(resume_line)
    if plot:
        _plot(out, result, sink, truth)
    return v.ok and resumed_ok and not sink.replica.stale


def resume_from_oldest(job: JobSpec, snapshots: Path, truth: Path, seed: int, until: int) -> tuple[bool, str]:
    """Train from the oldest snapshot in ``snapshots`` up to ``until``, as a trainer would,
    and compare with the uninterrupted run's state: ``(equal, what to print)``."""
    oldest = sorted(snapshots.glob(snapshot.PREFIX + "*"))[0]
    model_sd = torch.load(oldest / "model.pt", weights_only=True)          # the two lines a trainer runs
    optim_sd = torch.load(oldest / "optimizer.pt", weights_only=True)
    start = snapshot.verify(oldest)["iteration"]
    trainer = resume(job, {"model": model_sd, "optimizer": optim_sd, "iteration": start}, seed, until)
    with np.load(iteration_dir(truth, until - 1) / "state.npz") as t:
        d = compare_state(until - 1, optimizer_arrays(trainer.model, trainer.optimizer), dict(t))
    if d is not None:
        return False, f"[red]resumed at {start}, trained to {until - 1}: {d}[/]"
    return True, (f"resumed from {oldest.name} (iteration {start}), trained iterations {start}..{until - 1}: "
                  f"[green]bit-identical to the uninterrupted run[/]")


def _plot(out: Path, result: ReplayResult, sink: ReplicaSink, truth: Path) -> Path:
    from gradtap.plot import iteration_plot      # matplotlib: only when a plot is kept

    timing = {t.iteration: t for t in result.timings}
    its = [line["iteration"] for line in sink.lines]
    spans = json.loads((truth / "manifest.json").read_text())["span_ns"]
    durations = [(spans[str(i)][1] - spans[str(i)][0]) / 1e9 for i in its]
    stages = {name: [getattr(timing[i], f"{name}_s", 0.0) if i in timing else 0.0 for i in its]
              for name in ("parse", "merge", "update")}
    coverage = {s: [line["coverage"].get(s, 0.0) for line in sink.lines] for s in result.frames}
    lost = [line["iteration"] for line in sink.lines if not line["recovered"]]
    return iteration_plot(out / "replay" / "iterations.png", its, stages, durations, coverage, lost)
