"""Opening a job spec file for a command: every error in it names the file.

``load_job`` checks the spec's form; the model's keyword arguments are only tried when the
model is built (the factory's own checks, such as ``sizes: abc``). The commands open a job
spec here, which builds the model's description once (on the meta device), so that such an
error also names the file it is in.
"""

from __future__ import annotations

from pathlib import Path

from gradtap.core.errors import ConfigError
from gradtap.workload.layout import job_params
from gradtap.workload.spec import JobSpec, load_job


def open_job(path: Path) -> JobSpec:
    """The job spec at ``path``, its model checked; ``ConfigError`` naming ``path`` otherwise."""
    job = load_job(path)
    try:
        job_params(job)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return job
