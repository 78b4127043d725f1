"""``gradtap demo``: the whole idea, end to end, on a small job, in a few seconds.

1. **Simulate** training of the built-in small job (4 data-parallel ranks, a 1M-parameter
   MLP, AdamW with warm-up and clipping) and the RoCEv2 traffic its ring allreduce puts on
   the wire, mirrored to 3 capture files with a realistic mix of faults.
2. **Replay** the captures through the appliance: parse, merge, update a replica.
3. **Verify** the replica against the trainer's true state after every iteration.
4. **Resume**: a trainer loads the replica's oldest snapshot with two standard PyTorch
   calls, trains on, and must end exactly where the uninterrupted trainer ended.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import torch
import typer
from rich.console import Console
from rich.panel import Panel

from gradtap.cli import app
from gradtap.configs import shipped
from gradtap.commands.replay import events_table, iteration_table, run_replay, verification_lines
from gradtap.commands.simulate import run_simulation, summary_table
from gradtap.plot import iteration_plot
from gradtap.verify import _first_difference, verify
from gradtap.simulator.run import resume
from gradtap.simulator.truth import optimizer_arrays
from gradtap.updater import snapshot
from gradtap.workload.layout import job_params
from gradtap.workload.spec import load_job

console = Console()
CONFIG = shipped("small.yaml")
FAULTS = "mirror_loss=2e-3,link_loss=1e-3,corrupt=5e-4,reorder=1e-3,duplicate=1e-3,truncate=2e-4"


@app.command()
def demo(
    out: Path = typer.Option(None, "--out", "-o", help="where to keep everything (default: a new temporary directory)"),
    iterations: int = typer.Option(6, "--iterations", "-n", min=2, help="training iterations to capture"),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Simulate, replay, verify bit for bit, resume from the replica, and report."""
    out = Path(out) if out else Path(tempfile.mkdtemp(prefix="gradtap-demo-"))
    console.print(Panel.fit(
        "gradtap rebuilds a training job's checkpoint from a switch mirror of its NCCL allreduce traffic.\n"
        f"This demo simulates a small job, mirrors 3 ports with faults ({FAULTS}),\n"
        f"replays the captures through the appliance and checks the result. Everything goes to {out}",
        title="gradtap demo"))

    console.rule("1. simulate: real PyTorch training, NCCL-faithful RoCEv2 traffic")
    sim = run_simulation(CONFIG, out / "sim", iterations, seed, FAULTS, "pcap", 100.0)
    console.print(summary_table(sim))
    job = load_job(out / "sim" / "job.yaml")
    truth = out / "sim" / "truth"

    console.rule("2. replay: parse, merge and update a replica from the captures")
    streams = {s.name: s.path for s in sim.streams}
    # Small batches, so the pipeline streams through the captures as it would live.
    result, sink = run_replay(job, streams, out / "replay", torch.load(truth / "start.pt", weights_only=True),
                              batch_frames=2048)
    console.print(iteration_table(result, sink))
    console.print(events_table(result))

    console.rule("3. verify: the replica against the trainer, bit for bit")
    params = job_params(job)
    v = verify(out / "replay", truth, params)
    for line in verification_lines(v):
        console.print(line)

    console.rule("4. resume: a trainer restarts from the replica's oldest snapshot")
    resumed_ok, resume_line = _resume(job, out / "replay" / "snapshots", truth, seed, sim.iterations[-1] + 1)
    console.print(resume_line)

    png = _plot(out, result, sink, sim.iterations, truth)
    ok = v.ok and resumed_ok and not sink.replica.stale
    console.print(Panel.fit(
        ("[bold green]The replica equals the trainer after every iteration, and a trainer resumed from it "
         "continues exactly as if it had never stopped.[/]" if ok else
         "[bold red]Something did not match; see above.[/]") +
        f"\nreport: {out / 'replay' / 'replay.json'}\nplot:   {png}\nevents: {out / 'replay' / 'events.jsonl'}",
        title="result"))
    if not ok:
        raise typer.Exit(1)


def _resume(job, snapshots: Path, truth: Path, seed: int, until: int) -> tuple[bool, str]:
    oldest = sorted(snapshots.glob(snapshot.PREFIX + "*"))[0]
    model_sd = torch.load(oldest / "model.pt", weights_only=True)          # the two lines a trainer runs
    optim_sd = torch.load(oldest / "optimizer.pt", weights_only=True)
    start = snapshot.verify(oldest)["iteration"]
    trainer = resume(job, {"model": model_sd, "optimizer": optim_sd, "iteration": start}, seed, until)
    resumed = optimizer_arrays(trainer.model, trainer.optimizer)
    with np.load(truth / f"iter_{until - 1:06d}" / "state.npz") as t:
        for key in t.files:
            if key == "step":
                same = int(resumed[key]) == int(t[key])
            else:
                same = _first_difference(until - 1, key, resumed[key], t[key]) is None
            if not same:
                return False, f"[red]resumed at {start}, trained to {until - 1}: {key} differs from the uninterrupted run[/]"
    return True, (f"resumed from {oldest.name} (iteration {start}), trained iterations {start}..{until - 1}: "
                  f"[green]bit-identical to the uninterrupted run[/]")


def _plot(out: Path, result, sink, iterations: list[int], truth: Path) -> Path:
    timing = {t.iteration + sink.first: t for t in result.timings}
    its = [line["iteration"] for line in sink.lines]
    spans = json.loads((truth / "manifest.json").read_text())["span_ns"]
    durations = [(spans[str(i)][1] - spans[str(i)][0]) / 1e9 for i in its]
    stages = {name: [getattr(timing[i], f"{name}_s", 0.0) if i in timing else 0.0 for i in its]
              for name in ("parse", "merge", "update")}
    coverage = {s: [line["coverage"].get(s, 0.0) for line in sink.lines] for s in result.frames}
    lost = [line["iteration"] for line in sink.lines if not line["recovered"]]
    return iteration_plot(out / "replay" / "iterations.png", its, stages, durations, coverage, lost)
