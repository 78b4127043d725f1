"""The trainer's side of gradtap: what a training script imports (``gradtap.trainer``)."""

from gradtap.trainer.describe import describe, describe_to

__all__ = ["describe", "describe_to"]
