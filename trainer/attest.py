"""Attestation: the trainer says what its state is, and the appliance checks its replica.

Nothing else compares the replica with the trainer while the job runs; a wrong job spec, a
changed learning rate or a step the trainer skipped (a grad scaler's inf/nan) would show
only at restore. So the trainer sends, as often as it likes, a *fingerprint* of its state
after an optimizer step, and the appliance compares it with its replica at the same
iteration (``gradtap/attestation.py``; ``POST /attest``).

A fingerprint is cheap enough for every iteration: per parameter and per kind of tensor
(the parameter, Adam's ``exp_avg`` and ``exp_avg_sq``), a sha256 (first 16 hex digits) of
the float32 bit patterns of :data:`SAMPLES` elements at fixed, evenly spread positions of
the flattened tensor (:func:`positions`), and the step count. Gathering them is a few
thousand element reads on the GPU. It proves no more than those elements, but whatever
makes a replica drift (another learning rate, a skipped step, a wrong bucket layout)
changes every element, and a difference names the parameter and the kind.

    fp = fingerprint(iteration, model, optimizer)     # after optimizer.step(): the state of `iteration`
    Attestor("http://mirror-node:9465", token_file).send(fp)

``iteration`` is the trainer's iteration whose forward pass comes next (the checkpoint
convention: the state after the step of ``iteration - 1``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from gradtap.trainer.control_client import post_json

FORMAT = "gradtap-attest/1"
SAMPLES = 64
KINDS = ("param", "exp_avg", "exp_avg_sq")


def positions(numel: int, samples: int = SAMPLES) -> np.ndarray:
    """The flat positions sampled in a tensor of ``numel`` elements: evenly spread, the
    first and the last included; all of them when there are no more than ``samples``."""
    if numel <= samples:
        return np.arange(numel, dtype=np.int64)
    return (np.arange(samples, dtype=np.int64) * (numel - 1)) // (samples - 1)


def sample_hash(values: np.ndarray) -> str:
    """The hash of sampled float32 values (their bit patterns, little-endian)."""
    return hashlib.sha256(np.ascontiguousarray(values, "<f4").tobytes()).hexdigest()[:16]


def fingerprint_of(iteration: int, step: int, tensors: Iterable[tuple[str, dict[str, np.ndarray]]]) -> dict:
    """A fingerprint from ``(name, {kind: the sampled float32 values})`` per parameter."""
    return {"format": FORMAT, "iteration": int(iteration), "step": int(step), "samples": SAMPLES,
            "params": {name: {kind: sample_hash(v[kind]) for kind in KINDS} for name, v in tensors}}


def fingerprint(iteration: int, model, optimizer) -> dict:
    """The fingerprint of a torch ``model`` and its Adam/AdamW ``optimizer`` (after a step):
    its trainable parameters in registration order, as DDP buckets them."""
    import torch

    out, step = [], 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        state = optimizer.state.get(p, {})
        if "exp_avg" not in state:
            raise ValueError(f"optimizer has no Adam state for {name}: fingerprint after an optimizer step")
        idx = torch.from_numpy(positions(p.numel())).to(p.device)
        out.append((name, {kind: t.detach().reshape(-1)[idx].float().cpu().numpy()
                           for kind, t in (("param", p), ("exp_avg", state["exp_avg"]),
                                           ("exp_avg_sq", state["exp_avg_sq"]))}))
        step = int(state["step"])
    return fingerprint_of(iteration, step, out)


class Attestor:
    """Sends fingerprints to an appliance's control endpoint (bearer token from ``token_file``)."""

    def __init__(self, appliance: str, token_file: Path, timeout_s: float = 5.0):
        self.url = f"{appliance.rstrip('/')}/attest"
        self.token = Path(token_file).read_text().strip()
        self.timeout_s = timeout_s

    def send(self, fp: dict) -> dict:
        """The appliance's answer; :class:`~gradtap.trainer.control_client.Refused` (a
        ``RuntimeError``) with its reason when it refuses."""
        return post_json(self.url, fp, self.token, self.timeout_s)
