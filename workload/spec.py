"""The job spec: the one description of a training job that every gradtap stage shares.

A job spec is a YAML file (see ``configs/``). :func:`load_job` reads and validates it; every
error names the field, the bad value and what is allowed. The validated :class:`JobSpec` is
passed explicitly to each stage; nothing here is global.
"""

from __future__ import annotations

import ipaddress
import re
import sys
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from gradtap.core.errors import ConfigError

MIRROR_NAME = re.compile(r"^[a-zA-Z0-9][-a-zA-Z0-9_]{0,31}$")
MAC = re.compile(r"^[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}$")
# NCCL minor releases whose wire facts are checked (docs/wire-format.md, "NCCL eras 2.19 – 2.30");
# "2.19" also covers 2.18.x. gradtap.workload.nccl.ERAS holds the facts of each.
SUPPORTED_ERAS = tuple(f"2.{minor}" for minor in range(19, 31))
TORCH_DTYPES = ("float32", "float16", "bfloat16", "float64")
WIRE_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ParamSpec:
    """One model parameter as the trainer registers it (``named_parameters`` order)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}[self.dtype]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ParamEntry(_Strict):
    name: str
    shape: tuple[Annotated[int, Field(ge=1)], ...]
    dtype: Literal[TORCH_DTYPES] = "float32"  # type: ignore[valid-type]


# Packages whose factories a job spec may name without ``model.trusted``: they build models
# and nothing else. A factory is code that runs in the appliance, with its privileges.
TRUSTED_FACTORY_PACKAGES = ("gradtap.workload.models", "torch.nn", "torchvision.models", "timm", "transformers")


class ModelSpec(_Strict):
    """Either an import path of a ``torch.nn.Module`` factory, or the parameter list itself.

    A factory is imported and called: a job spec names code that runs. Only the packages of
    :data:`TRUSTED_FACTORY_PACKAGES` are taken as they are; any other module needs ``trusted:
    true`` (the operator vouches for it: set it only for your own model code), and the
    standard library never (it holds no model, and ``subprocess:run`` would run anything)."""

    factory: str | None = Field(None, description="'module:callable' returning a torch.nn.Module")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    params: tuple[ParamEntry, ...] | None = None
    trusted: bool = Field(False, description="the factory's module, outside the model packages gradtap knows, "
                                             "is trusted to run in the appliance")

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSpec":
        if (self.factory is None) == (self.params is None):
            raise ValueError("give exactly one of 'factory' (an import path 'module:callable') or 'params' (a list)")
        if self.factory is not None and not re.fullmatch(r"[\w.]+:[\w.]+", self.factory):
            raise ValueError(f"factory {self.factory!r} is not an import path of the form 'package.module:callable'")
        if self.factory is not None:
            module = self.factory.partition(":")[0]
            if module.split(".")[0] in sys.stdlib_module_names or module.split(".")[0] == "builtins":
                raise ValueError(f"factory {self.factory!r} is in Python's standard library, which holds no model; "
                                 "name a function that returns a torch.nn.Module")
            known = any(module == pkg or module.startswith(pkg + ".") for pkg in TRUSTED_FACTORY_PACKAGES)
            if not known and not self.trusted:
                raise ValueError(f"factory {self.factory!r}: its module runs in the appliance and is not one of the "
                                 f"model packages gradtap knows ({', '.join(TRUSTED_FACTORY_PACKAGES)}); if it is "
                                 "your own model code, set model.trusted: true")
        return self


class InitialState(_Strict):
    seed: int | None = 0
    checkpoint: Path | None = None

    @model_validator(mode="after")
    def _one_source(self) -> "InitialState":
        if self.checkpoint is not None and self.seed not in (None, 0):
            raise ValueError("give either 'seed' or 'checkpoint', not both")
        return self


class DDPSpec(_Strict):
    bucket_cap_mb: float | None = Field(
        None, gt=0, description="DDP's bucket_cap_mb. Unset: DDP's default, 25 MiB buckets after a 1 MiB first "
                                "bucket; any value (even 25) makes the first bucket as large as the others")
    layout: Literal["initial", "rebuilt", "explicit"] = "rebuilt"
    buckets: tuple[tuple[str, ...], ...] | None = Field(None, description="parameter names per bucket, in launch order")
    grad_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    predivide: bool = Field(True, description="gradients are divided by the world size before the allreduce")

    @model_validator(mode="after")
    def _explicit_needs_buckets(self) -> "DDPSpec":
        if (self.layout == "explicit") != (self.buckets is not None):
            raise ValueError("layout 'explicit' requires 'buckets' (a list of parameter-name lists), and only it accepts them")
        return self


class Schedule(_Strict):
    kind: Literal["constant", "warmup_cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    total_steps: int = Field(1, ge=1)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)


class OptimizerSpec(_Strict):
    kind: Literal["adam", "adamw"] = "adam"
    lr: float = Field(1e-3, gt=0)
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    implementation: Literal["single_tensor", "foreach", "fused"] = "single_tensor"
    schedule: Schedule = Schedule()
    clip_grad_norm: float | None = Field(None, gt=0)


class TunerSpec(_Strict):
    """What NCCL's tuner sees of the cluster, for ``nccl.protocol: auto`` in the simulator
    (``workload/tuner.py``; docs/wire-format.md, "The tuner's protocol choice").

    gradtap reads ring allreduce, so the model is NCCL's Ring algorithm only: the trainer runs
    with ``NCCL_ALGO=Ring`` (without it NCCL may pick Tree, NVLS or CollNet, which gradtap does
    not decode)."""

    algorithm: Literal["Ring"] = Field("Ring", description="NCCL_ALGO; only Ring, the algorithm gradtap reads")
    compute_capability: int = Field(90, ge=60, le=130, description="the GPUs' compute capability x10 (70 Volta, 80 "
                                                                   "Ampere, 90 Hopper, 100 Blackwell), all alike")
    ppn: int = Field(1, ge=1, le=64, description="ranks of the ring (communicator) per node")
    nodes: int | None = Field(None, ge=2, le=64, description="nodes of the ring; unset: ring size / ppn")
    nic_gbps: float = Field(200.0, gt=0, le=3200, description="line rate of a rank's NIC, Gb/s (ibstat 'Rate'); "
                                                              "NCCL's graph search gets its ring bandwidth from it")
    graph_channels: int | None = Field(None, ge=1, le=64, description="the ring graph's nChannels as NCCL logs it "
                                       "(NCCL_DEBUG_SUBSYS=GRAPH: 'Pattern 4, crossNic 0, nChannels N, bw X/Y'); "
                                       "with graph_bw, overrides the graph derived from nic_gbps")
    graph_bw: float | None = Field(None, gt=0, le=1000, description="the ring graph's per-channel bw (GB/s, the Y "
                                   "of that line); with graph_channels")
    nvlink: bool = Field(True, description="the node's GPUs talk over NVLink (ppn > 1 only: intra-node latency, "
                                           "and LL128 needs it)")
    gpu_nic_path: Literal["PIX", "PXB", "PXN", "PHB", "SYS"] = Field(
        "PIX", description="PCIe path from a GPU to its NIC as nvidia-smi topo -m shows it (NODE is PHB): "
                           "LL128 is on by default only up to PXB (PXN on Hopper and later)")
    cpu_vendor: Literal["intel", "amd", "other"] = Field("intel", description="the hosts' CPU vendor (x86 Intel, "
                                                        "x86 AMD, or other): the LL bandwidth cap and net overhead")
    ll128: bool | None = Field(None, description="LL128 enabled (NCCL_PROTO includes it) or disabled; unset: "
                                                 "NCCL's default rule for the era and GPUs")

    @model_validator(mode="after")
    def _graph_pair(self) -> "TunerSpec":
        if (self.graph_channels is None) != (self.graph_bw is None):
            raise ValueError("give graph_channels and graph_bw together (both from NCCL's 'Pattern 4, ..., "
                             "nChannels N, bw X/Y' line), or neither to derive the graph from nic_gbps")
        return self


class NcclSpec(_Strict):
    """The NCCL settings that shape the wire. Defaults are NCCL 2.19's (see docs/wire-format.md)."""

    era: str = Field("2.19", description="NCCL minor release, '2.19' (2.18.x-2.19.x) to '2.30', or 'auto': "
                                        "the appliance reads it from the wire at lock-on")
    protocol: Literal["Simple", "LL", "LL128", "auto"] = Field(
        "Simple", description="every bucket's protocol, or 'auto': per bucket as NCCL's tuner picks it by size "
                              "(the appliance reads it from the wire at lock-on; the simulator models the tuner)")
    protocols: tuple[Literal["Simple", "LL", "LL128"], ...] | None = Field(
        None, min_length=1, description="per DDP bucket in launch order: the protocol NCCL's tuner chose for that "
                                        "bucket's allreduce (it picks per call, by size); unset: every bucket uses "
                                        "'protocol'")
    tuner: TunerSpec = Field(default_factory=lambda: TunerSpec(),
                             description="the topology NCCL's tuner sees, for protocol 'auto' in the simulator")
    channels: int = Field(2, ge=1, le=32)
    qps_per_connection: int = Field(1, ge=1, le=128)
    split_data_on_qps: bool | None = Field(None, description="NCCL_IB_SPLIT_DATA_ON_QPS; default from the era")
    adaptive_routing: bool = Field(False, description="NCCL_IB_ADAPTIVE_ROUTING")
    ar_threshold: int = Field(8192, ge=0, description="NCCL_IB_AR_THRESHOLD, bytes")
    buffsize: dict[Literal["Simple", "LL", "LL128"], Annotated[int, Field(gt=0)]] = Field(default_factory=dict)
    nthreads: int | None = Field(None, ge=64, le=640, description="NCCL_NTHREADS / NCCL_LL128_NTHREADS")
    mtu: Literal[1024, 2048, 4096] = 1024
    ib_ooo_rq: bool = Field(False, description="NCCL_IB_OOO_RQ (2.30+): refused, ImmDt then carries a request ID")

    @property
    def resolved(self) -> bool:
        """Whether the wire is fixed by the spec alone (no ``auto`` left to read from the wire)."""
        return self.era != "auto" and (self.protocol != "auto" or self.protocols is not None)

    @field_validator("era")
    @classmethod
    def _known_era(cls, v: str) -> str:
        if v != "auto" and v not in SUPPORTED_ERAS:
            raise ValueError(f"NCCL era {v!r} is not supported; supported eras: {', '.join(SUPPORTED_ERAS)} "
                             "(one per NCCL minor release; 2.19 also covers NCCL 2.18.x). Give the "
                             "major.minor of the trainer's NCCL, e.g. '2.21' for NCCL 2.21.5, or 'auto'")
        return v

    @field_validator("ib_ooo_rq")
    @classmethod
    def _index_matching(cls, v: bool, info: ValidationInfo) -> bool:
        # NCCL 2.30 matches receives by request ID when NCCL_IB_OOO_RQ=1 (or
        # NCCL_IB_RESILIENCY_PORT_FAILOVER=1, NCCL_IB_RECEIVER_SIDE_MATCHING_SCHEME=1): ImmDt
        # then carries the ID, not the size, and the wire plan does not model that.
        if v:
            era = info.data.get("era", "2.30")
            where = ("NCCL_IB_OOO_RQ does not exist before NCCL 2.30" if era not in ("2.30", "auto") else
                     "with NCCL_IB_OOO_RQ=1, NCCL 2.30 writes a request ID into ImmDt instead of the message "
                     "size (ID-based receive matching), which gradtap does not decode")
            raise ValueError(f"{where}; run the trainer without NCCL_IB_OOO_RQ, "
                             "NCCL_IB_RESILIENCY_PORT_FAILOVER and NCCL_IB_RECEIVER_SIDE_MATCHING_SCHEME=1, "
                             "and set nccl.ib_ooo_rq false")
        return v


class RankSpec(_Strict):
    ip: str
    mac: str
    qpn_base: int | None = Field(None, ge=2, lt=1 << 24,
                                 description="a hint: first QPN of this rank's ring connections (base + 2*index "
                                             "+ receiver); the parser learns QPNs from the wire and checks "
                                             "hints; the simulator uses it (default 0x100*(position+1))")
    udp_sport_base: int | None = Field(None, ge=1, le=65535,
                                       description="UDP source port of this rank's first send connection; default 49152+64*position")

    @field_validator("ip")
    @classmethod
    def _ip(cls, v: str) -> str:
        try:
            return str(ipaddress.ip_address(v))
        except ValueError:
            raise ValueError(f"{v!r} is not an IPv4 or IPv6 address") from None

    @field_validator("mac")
    @classmethod
    def _mac(cls, v: str) -> str:
        if not MAC.fullmatch(v):
            raise ValueError(f"{v!r} is not a MAC address like 02:00:00:00:00:01")
        return v.lower()


class RingSpec(_Strict):
    ranks: tuple[RankSpec, ...] = Field(..., min_length=2, max_length=64, description="ranks in ring order")

    @model_validator(mode="after")
    def _consistent(self) -> "RingSpec":
        versions = {ipaddress.ip_address(r.ip).version for r in self.ranks}
        if len(versions) != 1:
            raise ValueError("all ranks must use the same IP version (RoCEv2 over IPv4 or over IPv6)")
        for what in ("ip", "mac"):
            seen: dict[str, int] = {}
            for i, r in enumerate(self.ranks):
                v = getattr(r, what)
                if v in seen:
                    raise ValueError(f"ranks[{i}].{what} {v!r} repeats ranks[{seen[v]}].{what}; each rank needs its own")
                seen[v] = i
        return self


class MirrorSpec(_Strict):
    name: str
    rank: int = Field(..., ge=0, description="ring position whose NIC port is mirrored")
    direction: Literal["ingress", "egress", "both"]
    encapsulation: Literal["none", "erspan2", "erspan3"] = "none"

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not MIRROR_NAME.fullmatch(v):
            raise ValueError(f"{v!r} must match {MIRROR_NAME.pattern}")
        return v


class TrainingSpec(_Strict):
    """What the simulator trains on (the appliance ignores it)."""

    batch_size: int = Field(8, ge=1)
    data_kwargs: dict[str, Any] = Field(default_factory=dict)


def _http_url(v: str | None) -> str | None:
    """An optional http:// or https:// URL, as a field validator takes it."""
    if v is not None and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", v):
        raise ValueError(f"{v!r} is not an http:// or https:// URL")
    return v


class StoreSpec(_Strict):
    """The durable tier: snapshots also go, in the background, to an fsspec URL
    (``store/object_store.py``; docs/store.md, "Storage tiers")."""

    url: str = Field(..., description="fsspec URL of the store: file:///DIR or s3://BUCKET/PREFIX")
    endpoint_url: str | None = Field(None, description="an S3-compatible endpoint (MinIO, Ceph, ...) for s3:// "
                                     "URLs; unset: AWS, or the AWS_ENDPOINT_URL environment variable")
    keep_last: int = Field(3, ge=1, description="READY snapshots kept in the store (the newest iterations)")
    keep_every: int | None = Field(None, ge=1, description="also keep every snapshot whose iteration is a "
                                   "multiple of this (unset: none beyond keep_last)")
    retry_min_s: float = Field(0.5, gt=0, description="first wait after a failed upload; doubles per failure")
    retry_max_s: float = Field(30.0, gt=0, description="longest wait between upload attempts")
    close_timeout_s: float = Field(60.0, ge=0, description="how long a clean shutdown waits for the last "
                                   "upload to finish")
    gradient_log: bool = Field(False, description="also append every applied iteration's merged gradient to the "
                               "store, so any iteration since a snapshot can be rebuilt (gradtap restore --at)")
    gradient_log_queue: int = Field(3, description="gradients the log holds in memory (one being copied, the rest "
                                    "waiting for the store); each takes the gradient's wire size")

    @field_validator("gradient_log", mode="before")
    @classmethod
    def _gradient_log(cls, v: Any) -> bool:
        if not isinstance(v, bool):
            raise ValueError(f"gradient_log is {v!r}; give true (log every iteration's gradient to the store) "
                             "or false")
        return v

    @field_validator("gradient_log_queue", mode="before")
    @classmethod
    def _gradient_log_queue(cls, v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not 2 <= v <= 64:
            raise ValueError(f"gradient_log_queue is {v!r}; give a whole number of gradients from 2 (one being "
                             "copied, one being written) to 64")
        return v

    @field_validator("url")
    @classmethod
    def _store_url(cls, v: str) -> str:
        if not re.fullmatch(r"[a-z][a-z0-9+.-]*://\S+", v):
            raise ValueError(f"{v!r} is not a store URL (file:///DIR, s3://BUCKET/PREFIX)")
        return v.rstrip("/")

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        return _http_url(v)

    @model_validator(mode="after")
    def _retry(self) -> "StoreSpec":
        if self.retry_max_s < self.retry_min_s:
            raise ValueError(f"retry_max_s {self.retry_max_s} is below retry_min_s {self.retry_min_s}")
        return self


class MirrorGroupSpec(_Strict):
    """This appliance's place among the CPU nodes its DP group's mirror streams arrive at: they
    merge over torch.distributed's gloo and each steps a shard of the replica (merger/group.py,
    docs/group.md). ``gradtap netconfig plan`` writes one per group and node."""

    rank: int = Field(..., ge=0, description="this node's rank in the group, 0..world_size-1")
    world_size: int = Field(..., ge=1, description="the group's CPU nodes")
    rendezvous: str = Field(..., description="tcp://HOST:PORT (rank 0 listens there) or file:///PATH (a file every "
                            "node reaches, absent before the group starts)")
    timeout_s: float = Field(60.0, gt=0, description="longest wait for a peer, rendezvous included; a peer silent "
                             "this long is reported gone")
    interface: str = Field("", description="network interface for the group's own traffic (unset: the one the "
                           "host name resolves to)")
    streams: tuple[tuple[str, ...], ...] = Field((), description="the mirror streams each node of the group captures, "
                                                 "by rank (the same list on every node; gradtap netconfig plan writes "
                                                 "it): each node then owns buckets its own streams cover, so its peers "
                                                 "send it least (workload/shards.py); unset: buckets are dealt by size "
                                                 "alone")

    @field_validator("rendezvous")
    @classmethod
    def _rendezvous(cls, v: str) -> str:
        if not re.fullmatch(r"tcp://[^\s/:]+:\d{1,5}|tcp://\[[0-9a-fA-F:.]+\]:\d{1,5}|file:///\S+", v):
            raise ValueError(f"{v!r} is neither tcp://HOST:PORT nor file:///PATH")
        return v

    @model_validator(mode="after")
    def _rank_in_group(self) -> "MirrorGroupSpec":
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is outside the group (ranks 0..{self.world_size - 1})")
        if self.streams:
            if len(self.streams) != self.world_size:
                raise ValueError(f"streams lists {len(self.streams)} nodes' streams; the group has {self.world_size} "
                                 "nodes: give one list per rank, in rank order")
            seen: dict[str, int] = {}
            for rank, names in enumerate(self.streams):
                if not names:
                    raise ValueError(f"streams[{rank}] is empty: a node of a group needs a stream of its own")
                for name in names:
                    if name in seen:
                        raise ValueError(f"streams: {name!r} is listed for ranks {seen[name]} and {rank}; a stream "
                                         "arrives at one node")
                    seen[name] = rank
        return self


def parse_mirror_group(data: dict[str, Any], source: str) -> MirrorGroupSpec:
    """A mirror group from flags (``source`` names them in errors)."""
    try:
        return MirrorGroupSpec.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(source, err).replace("invalid job spec", "invalid mirror group")) from None


class ApplianceSpec(_Strict):
    """How the appliance runs this job (capture, parse, merge, update, snapshot)."""

    verify_icrc: bool = Field(True, description="check every RoCEv2 frame's ICRC and drop the damaged ones "
                              "(decode.icrc_bad); off, a parse takes about 3/4 of the CPU time, and a frame damaged "
                              "inside a switch is used as it came (docs/parser.md)")
    iteration_gap_ns: int = Field(1_000_000, gt=0, description="pause in the job's traffic between iterations")
    control_endpoint: str | None = Field(None, description="trainer URL that receives fallback events (HTTP POST)")
    snapshot_every: int = Field(1, ge=1, description="write a snapshot every K iterations")
    snapshot_keep: int = Field(3, ge=1, description="snapshots kept on disk (the newest ones)")
    snapshot_buffers: int = Field(1, ge=0, description="copies of the replica's state (12 bytes per parameter "
                                  "each) that `gradtap run` writes snapshots from in the background, so the "
                                  "replica never waits for the disk (a snapshot due while all are being written "
                                  "is skipped and counted); 0: written on the update path. `gradtap replay` "
                                  "writes every due snapshot on the update path")
    lockon_timeout_s: float = Field(60.0, gt=0, description="a stream not locked on this long after its first "
                                    "frame (capture time) is reported: lockon.failed")
    lockon_frames: int = Field(5_000_000, gt=0, description="... or after this many frames")
    control_token_file: Path | None = Field(None, description="file holding the control endpoint's bearer token "
                                            "(mode 0600; created when missing)")
    resync_dirs: tuple[Path, ...] = Field((), description="directories the control endpoint may take trainer "
                                          "checkpoints from")
    store: StoreSpec | None = Field(None, description="durable store tier the snapshots are uploaded to "
                                    "(unset: the local directory only)")
    mirror_group: MirrorGroupSpec | None = Field(None, description="the CPU nodes this job's streams arrive at, "
                                                 "when not all at this one (unset: every stream comes here)")

    @field_validator("control_endpoint")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        return _http_url(v)


class JobSpec(_Strict):
    name: str = Field(..., pattern=r"^[\w.-]+$")
    model: ModelSpec
    initial_state: InitialState = InitialState()
    ddp: DDPSpec = DDPSpec()
    optimizer: OptimizerSpec = OptimizerSpec()
    nccl: NcclSpec = NcclSpec()
    ring: RingSpec
    mirrors: tuple[MirrorSpec, ...] = Field(..., min_length=1)
    training: TrainingSpec = TrainingSpec()
    appliance: ApplianceSpec = ApplianceSpec()

    @model_validator(mode="after")
    def _mirrors_fit_ring(self) -> "JobSpec":
        n = len(self.ring.ranks)
        names: set[str] = set()
        for i, m in enumerate(self.mirrors):
            if m.rank >= n:
                raise ValueError(f"mirrors[{i}].rank {m.rank} is outside the ring (ranks 0..{n - 1})")
            if m.name in names:
                raise ValueError(f"mirrors[{i}].name {m.name!r} is used twice; mirror names must be unique")
            names.add(m.name)
        return self

    @property
    def world_size(self) -> int:
        return len(self.ring.ranks)

    @property
    def ipv6(self) -> bool:
        return ipaddress.ip_address(self.ring.ranks[0].ip).version == 6

    def mirror(self, name: str) -> MirrorSpec:
        for m in self.mirrors:
            if m.name == name:
                return m
        raise ConfigError(f"mirror stream {name!r} is not in the job; its streams are: "
                          + ", ".join(m.name for m in self.mirrors))


def _format_errors(source: str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in e["loc"]).replace(".[", "[")
        msg = e["msg"].removeprefix("Value error, ")
        bad = e.get("input")
        shown = "" if isinstance(bad, dict) or e["type"] == "missing" else f" (got {bad!r})"
        lines.append(f"  {loc or '(top level)'}: {msg}{shown}")
    return f"{source}: invalid job spec\n" + "\n".join(lines)


def parse_job(data: Any, source: str = "<job>") -> JobSpec:
    """Validate an already-parsed YAML/JSON document as a job spec."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a job spec is a YAML mapping, got {type(data).__name__}")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(source, err)) from None


def load_job(path: str | Path) -> JobSpec:
    """Read and validate a job spec YAML file."""
    path = Path(path)
    return _beside(parse_job(read_job_document(path), str(path)), path.parent)


def read_job_document(path: str | Path) -> Any:
    """A job spec file's YAML document, not yet validated (``gradtap discover`` completes a
    partial one); every error names the file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the job spec ({exc.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: (top level): not a text file (byte 0x{raw[exc.start]:02x} at offset {exc.start} "
                          "is not UTF-8); a job spec is a YAML file such as configs/small.yaml") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{path}: (top level): nested too deeply for a job spec; a job spec is a YAML file "
                          "such as configs/small.yaml") from None
    return data


def _beside(job: JobSpec, directory: Path) -> JobSpec:
    """The job with its relative file paths taken relative to ``directory`` (its YAML file's),
    as a reader of the file expects, not to wherever the command runs."""
    def here(p: Path | None) -> Path | None:
        return p if p is None or p.is_absolute() else directory / p

    a = job.appliance
    return job.model_copy(update={
        "initial_state": job.initial_state.model_copy(update={"checkpoint": here(job.initial_state.checkpoint)}),
        "appliance": a.model_copy(update={"control_token_file": here(a.control_token_file),
                                          "resync_dirs": tuple(here(d) for d in a.resync_dirs)})})


def dump_job(job: JobSpec) -> str:
    """The job as YAML, loadable by :func:`load_job`."""
    return yaml.safe_dump(job.model_dump(mode="json", exclude_none=True), sort_keys=False)
