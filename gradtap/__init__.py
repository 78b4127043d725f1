"""gradtap: an always-current training checkpoint rebuilt from mirrored RoCEv2 allreduce traffic."""

__version__ = "0.1.0"
