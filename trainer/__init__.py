"""The trainer's side of gradtap: what a training script imports (``gradtap.trainer``).

``describe`` / ``describe_to`` write the job spec's trainer sections from the live DDP job,
``Attestor`` sends the appliance fingerprints of the trainer's state, ``FallbackHandler``
answers the appliance's fallback with a checkpoint at the next step boundary, and
``restore`` loads the newest good replica (a snapshots directory, a snapshot, or an export)
into the trainer.
"""

from gradtap.trainer.attest import Attestor, fingerprint
from gradtap.trainer.describe import describe, describe_to
from gradtap.trainer.fallback import FallbackHandler, FallbackSettings
from gradtap.trainer.restore import restore

__all__ = ["Attestor", "FallbackHandler", "FallbackSettings", "describe", "describe_to", "fingerprint", "restore"]
