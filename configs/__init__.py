"""The shipped job specs (``*.yaml``) and cluster topologies (``topologies/*.yaml``), installed
as package data so that ``gradtap demo`` and the benchmarks find them outside a checkout."""

from importlib.resources import files
from pathlib import Path


def shipped(name: str) -> Path:
    """Path of a shipped config, e.g. ``shipped("small.yaml")`` or
    ``shipped("topologies/flowcheck-testbed.yaml")``."""
    return Path(str(files(__name__).joinpath(name)))
