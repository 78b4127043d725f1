"""A data-parallel training script that uses ``gradtap.trainer`` as a job's script would: one
process per rank, DDP over gloo on CPU.

    python -m tests.trainer.ddp_trainer --rank R --dir DIR --iterations N --appliance URL [--resume SOURCE]

Rank 0 starts the fallback handler and writes its endpoint to ``DIR/trainer-<tag>.json``. A
fresh run describes the job after its second step (``DIR/job.yaml``, merged into the
operator's file), saves that state as ``DIR/start-<tag>.pt`` and waits for ``DIR/go-<tag>``
(the appliance is up).
From then on, after every optimizer step, rank 0 attests its state and calls the fallback
handler's step boundary; each answer or refusal of the appliance is a line of
``DIR/attest-<tag>.jsonl``; fallback checkpoints go to ``DIR/resync/<tag>/``. ``--resume``
restores every rank first (from the appliance's snapshots, or a checkpoint file). The last
state goes to ``DIR/final-<tag>.pt``.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gradtap.trainer import (Attestor, FallbackHandler, FallbackSettings, describe_to, fingerprint,
                             restore)
from gradtap.workload.data import batch_loss
from gradtap.workload.models import build
from tests.gloo import gloo_group

WORLD = 2
FACTORY = "gradtap.workload.models:mlp"
KWARGS = {"sizes": [64, 96, 10]}
SEED = 5
BATCH = 4
CAP_MB = 0.01
LR = 1e-3
ENV = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL"}
DESCRIBE_AT = 1          # describe after the step of this iteration (DDP has rebuilt its buckets)
WAIT_S = 240.0           # for the appliance (the test simulates the run's traffic meanwhile)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--tag", required=True)
    parser.add_argument("--iterations", type=int, required=True)
    parser.add_argument("--appliance", required=True)
    parser.add_argument("--resume")
    args = parser.parse_args(argv)
    work, rank = args.dir, args.rank
    torch.set_num_threads(1)           # as the simulator's in-process ranks run (bit-equal arithmetic)
    with gloo_group(init_method=f"file://{work}/rendezvous-{args.tag}", rank=rank, world_size=WORLD,
                    timeout=timedelta(seconds=120)):
        model = build(FACTORY, KWARGS, seed=SEED)
        ddp = DDP(model, bucket_cap_mb=CAP_MB)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.01, foreach=False)
        data = model.synthetic_data(batch_size=BATCH, seed=SEED)
        start = restore(model, optimizer, args.resume) if args.resume else 0
        lead = rank == 0
        handler = attestor = None
        if lead:
            (work / "resync" / args.tag).mkdir(parents=True, exist_ok=True)
            handler = FallbackHandler(FallbackSettings(args.appliance, work / "control.token",
                                                       work / "resync" / args.tag))
            endpoint = json.dumps({"endpoint": handler.endpoint}).encode()
            _publish(work / f"trainer-{args.tag}.json", lambda f: f.write(endpoint))
            if args.resume:
                attestor = Attestor(args.appliance, work / "control.token", timeout_s=120)
        log = (work / f"attest-{args.tag}.jsonl").open("a") if lead else None
        for it in range(start, args.iterations):
            optimizer.zero_grad(set_to_none=True)
            batch_loss(ddp, data.batch(rank, it)).backward()
            optimizer.step()
            if not lead:
                continue
            if it == DESCRIBE_AT and not args.resume:
                describe_to(work / "job.yaml", ddp, optimizer, factory=FACTORY, kwargs=KWARGS, environ=ENV)
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iteration": it + 1}
                _publish(work / f"start-{args.tag}.pt", lambda f: torch.save(state, f))
                _wait_for(work / f"go-{args.tag}")
                attestor = Attestor(args.appliance, work / "control.token", timeout_s=120)
            if attestor is not None:
                try:
                    answer = attestor.send(fingerprint(it + 1, model, optimizer))
                except RuntimeError as exc:        # refused (the replica is stale): training goes on
                    answer = {"refused": str(exc)}
                handed = handler.step_boundary(model, optimizer, it + 1)
                log.write(json.dumps({"iteration": it + 1, "answer": answer,
                                      "handed_back": None if handed is None else str(handed)}) + "\n")
                log.flush()
        if lead:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "iteration": args.iterations, "fallback": vars(handler.counts) | {"checkpoints": [
                            str(p) for p in handler.counts.checkpoints]}}, work / f"final-{args.tag}.pt")
            handler.close()


def _publish(path: Path, write) -> None:
    """Write ``path`` whole or not at all: the test starts reading it as soon as it exists."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        write(f)
    tmp.rename(path)


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {WAIT_S} s")
        time.sleep(0.05)


if __name__ == "__main__":
    main()
