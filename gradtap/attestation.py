"""The trainer's attestations (``trainer/attest.py``), checked against the replica.

A fingerprint of the trainer's state at iteration k (after the step of k - 1) is held until
the replica's state is that of k (it has ended iteration k - 1 and not begun k), then the
replica's own fingerprint, taken the same way from its flat arrays, is compared with it.
Equal: counted (``attested``). Different: an ``integrity.mismatch`` event naming the first
tensor that differs (``tensor``: the parameter, ``state``: ``param``, ``exp_avg`` or
``exp_avg_sq``; or the step), then a ``fallback`` that asks the trainer for a checkpoint
(``gradtap.trainer.fallback``): the replica is stale until that checkpoint resyncs it, and
no snapshot is written from it.

One fingerprint is held at a time (a newer one replaces it). A fingerprint of a state the
replica has passed, or sent while the replica is stale, cannot be checked: it is refused
with the reason.
"""

from __future__ import annotations

import logging
import re

from gradtap.control import ControlPlane
from gradtap.core.errors import ConfigError
from gradtap.trainer.attest import FORMAT, KINDS, fingerprint_of, positions
from gradtap.updater.replica import Replica

log = logging.getLogger(__name__)

HASH = re.compile(r"[0-9a-f]{16}")


class Attestations:
    def __init__(self, replica: Replica, control: ControlPlane):
        self.replica, self.control = replica, control
        self.pending: dict | None = None
        self.attested = 0
        self.diverged = 0
        self.names = [p.name for p in replica.layout.params]

    def offer(self, fp: object) -> dict:
        """Hold (or check at once) the trainer's fingerprint ``fp``; the answer for the trainer.
        ``ConfigError`` saying why when it is malformed or cannot be checked."""
        fp = self._checked(fp)
        r, k = self.replica, fp["iteration"]
        if r.stale:
            raise ConfigError(f"fingerprint of iteration {k}: the replica is stale (waiting for a resync); nothing "
                              "to compare it with until then")
        if k < r.iteration or (k == r.iteration and r.open_iteration is not None):
            raise ConfigError(f"fingerprint of iteration {k}: the replica is past that state (it is at iteration "
                              f"{r.iteration}{', updating' if r.open_iteration is not None else ''}); send the "
                              "fingerprint right after the optimizer step")
        replaced = self.pending["iteration"] if self.pending is not None else None
        self.pending = fp
        self.reached()
        return {"accepted": True, "iteration": k, "checked": self.pending is None, "replaced": replaced}

    def reached(self) -> None:
        """The replica is between iterations: check the held fingerprint if it is of this state."""
        fp, r = self.pending, self.replica
        if fp is None or r.open_iteration is not None or r.stale:
            return
        if fp["iteration"] < r.iteration:
            log.warning("the trainer's fingerprint of iteration %d was not checked: the replica passed it",
                        fp["iteration"])
            self.pending = None
        elif fp["iteration"] == r.iteration:
            self.pending = None
            self._compare(fp)

    def _compare(self, fp: dict) -> None:
        r = self.replica
        mine = self.fingerprint()
        differs = None
        if mine["step"] != fp["step"]:
            differs = {"what": "step", "tensor": "step", "state": "step", "trainer": fp["step"],
                       "replica": mine["step"]}
        else:
            for name in self.names:
                for kind in KINDS:
                    if mine["params"][name][kind] != fp["params"][name][kind]:
                        differs = {"what": f"{kind} of {name}", "tensor": name, "state": kind,
                                   "trainer": fp["params"][name][kind],
                                   "replica": mine["params"][name][kind]}
                        break
                if differs:
                    break
        if differs is None:
            self.attested += 1
            return
        self.diverged += 1
        self.control.event("integrity.mismatch", iteration=fp["iteration"], **differs)
        log.error("the replica differs from the trainer at iteration %d: %s", fp["iteration"], differs["what"])
        r.stale = True
        self.control.fallback(fp["iteration"], f"the trainer's fingerprint differs from the replica's: "
                                               f"{differs['what']}")

    def fingerprint(self) -> dict:
        """The replica's fingerprint, taken as ``trainer.attest.fingerprint`` takes the trainer's."""
        r = self.replica
        s, layout = r.state, r.layout
        tensors = []
        for i, p in enumerate(layout.params):
            at = positions(p.numel)
            flat = layout.param(i)
            tensors.append((p.name, {kind: getattr(s, kind)[flat][at] for kind in KINDS}))
        return fingerprint_of(r.iteration, r.step, tensors)

    def _checked(self, fp: object) -> dict:
        def refuse(why: str) -> ConfigError:
            return ConfigError(f"not a {FORMAT} fingerprint: {why} (gradtap.trainer.attest.fingerprint makes one)")

        if not isinstance(fp, dict) or fp.get("format") != FORMAT:
            raise refuse("no format field, or another format")
        for key in ("iteration", "step"):
            v = fp.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise refuse(f"{key} is {v!r}, not an int >= 0")
        params = fp.get("params")
        if not isinstance(params, dict):
            raise refuse("params is not an object")
        if list(params) != self.names:
            missing, extra = set(self.names) - set(params), set(params) - set(self.names)
            raise ConfigError(f"fingerprint: its parameters are not the job's in order (missing "
                              f"{sorted(missing)[:3]}, not the job's {sorted(extra)[:3]}); fingerprint the model "
                              "the job spec describes")
        for name, kinds in params.items():
            if not isinstance(kinds, dict) or set(kinds) != set(KINDS) or \
                    not all(isinstance(h, str) and HASH.fullmatch(h) for h in kinds.values()):
                raise refuse(f"params[{name!r}] is not {{{', '.join(KINDS)}}} of 16 hex digits each")
        return fp
