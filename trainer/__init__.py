"""The trainer's side of gradtap: what a training script imports (``gradtap.trainer``)."""
