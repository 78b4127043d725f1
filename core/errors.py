"""The exception hierarchy.

Exceptions are for configuration and programming errors only. Bad *input* (malformed or
unexpected frames) is never raised: it is counted under a named decode event instead.
"""


class GradtapError(Exception):
    """Root of every error gradtap raises on purpose."""


class ConfigError(GradtapError):
    """A job spec, topology or command-line value is invalid. The message names the field,
    the bad value and what is allowed."""


class CaptureError(GradtapError):
    """A capture source cannot be opened or run (missing kernel feature, privileges, file)."""


class PlanError(GradtapError):
    """The wire plan cannot be derived for this job (a combination NCCL would not produce)."""


class NetlinkError(GradtapError):
    """A netlink operation failed; ``errno`` keeps the kernel's error number."""

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno
