"""What a day of training loses to failures, with ordinary checkpoints and with gradtap.

The inputs are a topology's ``cost:`` section (:class:`CostModel`); every one has a default,
and each default is FlowCheck's own input for its cost comparison (FlowCheck, EuroSys '25, § on
cost: an 8xA100 server at $30/h and a CPU server with an RDMA NIC at $1.37/h, Alibaba Cloud,
Sep 2024; 175B on 1536 GPUs; two failures a day; hourly checkpoints with native PyTorch). The
report says which inputs came from the topology and which are these defaults.

With G GPUs, g GPUs per server, server price P ($/h), F failures a day, checkpoint interval I
(h), stall per save S (s), C CPU nodes at price Q ($/h) and gradtap's loss per failure L (s)::

    servers          = G / g
    ordinary/day     = F * I/2 * servers * P            (work since the last save, on average I/2)
                     + 24/I * S/3600 * servers * P      (every save stalls every GPU)
    gradtap/day      = C * Q * 24                       (the CPU nodes, all day)
                     + F * L/3600 * servers * P         (the iteration in flight, plus restart)
    ratio            = ordinary/day / gradtap/day

FlowCheck's figures follow from its inputs: 2 * 1/2 * 192 * 30 = $5,760/day of lost work (it
counts no stall, S = 0) and 16 * 1.37 * 24 = $526.08/day of CPU nodes with no lost work
(L = 0). Restart time common to both (rescheduling, loading a checkpoint) cancels and is left
out; L is only what gradtap loses beyond it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, field_validator

HOURS_PER_DAY = 24.0
SECONDS_PER_HOUR = 3600.0

#: Where the defaults come from, as the report and errors cite it.
PAPER = "FlowCheck (EuroSys '25), § on cost"


class CostModel(BaseModel):
    """The ``cost:`` section of a topology. Prices in USD per hour; defaults are FlowCheck's inputs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Price of one CPU mirror node with its RDMA NIC (FlowCheck: $1.37/h, Alibaba Cloud, Sep 2024).
    cpu_node_usd_per_hour: float = 1.37
    #: Price of one GPU server of ``gpus_per_server`` GPUs (FlowCheck: 8xA100 at $30/h).
    gpu_server_usd_per_hour: float = 30.0
    gpus_per_server: int = 8
    #: Job failures a day that roll the training back (FlowCheck: two).
    failures_per_day: float = 2.0
    #: Hours between two ordinary checkpoints (FlowCheck: hourly, native PyTorch).
    checkpoint_interval_h: float = 1.0
    #: Seconds every GPU stalls per ordinary save (FlowCheck's $5,760 counts none: 0).
    checkpoint_stall_s: float = 0.0
    #: Work gradtap loses per failure, in seconds of the whole job: up to one iteration (the one
    #: in flight) plus restart time beyond an ordinary restart's (FlowCheck: almost none, 0).
    gradtap_lost_s_per_failure: float = 0.0
    #: CPU nodes of a figure to compare with, e.g. FlowCheck's 16 for the 175B layout; null for none.
    reference_cpu_nodes: int | None = None

    @field_validator("cpu_node_usd_per_hour", "gpu_server_usd_per_hour", "failures_per_day",
                     "checkpoint_stall_s", "gradtap_lost_s_per_failure")
    @classmethod
    def _non_negative(cls, value: float, info) -> float:
        if not value >= 0:  # also refuses NaN
            raise ValueError(f"{value:g} is not allowed (must be >= 0; {_HINT[info.field_name]})")
        if value == float("inf"):
            raise ValueError(f"{value:g} is not allowed (must be finite; {_HINT[info.field_name]})")
        return value

    @field_validator("checkpoint_interval_h")
    @classmethod
    def _interval(cls, value: float) -> float:
        if not 0 < value < float("inf"):
            raise ValueError(f"{value:g} is not allowed (must be > 0 and finite; "
                             f"{_HINT['checkpoint_interval_h']})")
        return value

    @field_validator("gpus_per_server", "reference_cpu_nodes")
    @classmethod
    def _positive_count(cls, value: int | None, info) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"{value!r} is not allowed (must be >= 1; {_HINT[info.field_name]})")
        return value


#: What each input means, for error messages (the fix is to give it in these units).
_HINT = {
    "cpu_node_usd_per_hour": "USD per hour for one CPU mirror node, e.g. 1.37 (FlowCheck)",
    "gpu_server_usd_per_hour": "USD per hour for one GPU server, e.g. 30 for 8xA100 (FlowCheck)",
    "failures_per_day": "failures that roll the job back, per day, e.g. 2 (FlowCheck)",
    "checkpoint_interval_h": "hours between ordinary checkpoints, e.g. 1 (FlowCheck)",
    "checkpoint_stall_s": "seconds the GPUs stall per ordinary save; 0 if saves are asynchronous",
    "gradtap_lost_s_per_failure": "seconds of job time gradtap loses per failure: one iteration plus extra restart",
    "gpus_per_server": "GPUs per priced GPU server, e.g. 8",
    "reference_cpu_nodes": "CPU nodes of a figure to compare with, or null",
}


@dataclass(frozen=True)
class DailyCost:
    """Expected USD per day, by the equations of this module's docstring."""

    gpu_servers: float
    ordinary_lost_work: float
    ordinary_stall: float
    cpu_nodes: int
    gradtap_cpu_nodes: float
    gradtap_lost_work: float

    @property
    def ordinary(self) -> float:
        return self.ordinary_lost_work + self.ordinary_stall

    @property
    def gradtap(self) -> float:
        return self.gradtap_cpu_nodes + self.gradtap_lost_work

    @property
    def ratio(self) -> float | None:
        """Ordinary over gradtap; None when gradtap costs nothing."""
        return self.ordinary / self.gradtap if self.gradtap > 0 else None


def daily_cost(model: CostModel, gpus: int, cpu_nodes: int) -> DailyCost:
    """Expected cost per day of a job on ``gpus`` GPUs, mirrored to ``cpu_nodes`` CPU nodes."""
    if gpus < 1:
        raise ValueError(f"Invalid GPU count: {gpus} (must be >= 1)")
    if cpu_nodes < 0:
        raise ValueError(f"Invalid CPU node count: {cpu_nodes} (must be >= 0)")
    servers = gpus / model.gpus_per_server
    fleet_per_hour = servers * model.gpu_server_usd_per_hour
    saves_per_day = HOURS_PER_DAY / model.checkpoint_interval_h
    return DailyCost(
        gpu_servers=servers,
        ordinary_lost_work=model.failures_per_day * model.checkpoint_interval_h / 2 * fleet_per_hour,
        ordinary_stall=saves_per_day * model.checkpoint_stall_s / SECONDS_PER_HOUR * fleet_per_hour,
        cpu_nodes=cpu_nodes,
        gradtap_cpu_nodes=cpu_nodes * model.cpu_node_usd_per_hour * HOURS_PER_DAY,
        gradtap_lost_work=model.failures_per_day * model.gradtap_lost_s_per_failure / SECONDS_PER_HOUR
        * fleet_per_hour,
    )


def input_sources(model: CostModel) -> dict[str, str]:
    """Each input's provenance: ``topology`` when the file gave it, else ``FlowCheck default`` (:data:`PAPER`)."""
    return {name: "topology" if name in model.model_fields_set else "FlowCheck default"
            for name in CostModel.model_fields if name != "reference_cpu_nodes"}
