"""The catalogue of decode events: every way a mirrored frame can be classified or refused.

Mirrored traffic is untrusted input, so kernels never raise on it: they count each frame
under exactly one event and move on. An event has a stable dotted name (``stage.what``) that
also names its Prometheus counter; kernels use its integer code. Codes are positions in
:data:`EVENTS` and may change between versions; names may not.

Three families:

- ``decode.*``: the frame is malformed or cut short; dropped.
- ``other.*``: a well-formed frame that is not this job's allreduce data (non-RoCE traffic,
  ACKs, CTS writes, other QPs, reduce-scatter data); counted and dropped.
- ``data.*``: this job's allreduce data: written, or refused for a stated reason.
"""

from __future__ import annotations

import numpy as np

EVENTS: tuple[tuple[str, str], ...] = (
    ("decode.ok", "decoded as a RoCEv2 packet with all its headers (stage 1 only)"),
    # stage 1: frame, Ethernet, IP, UDP, BTH
    ("decode.frame_truncated", "captured length shorter than the frame on the wire"),
    ("decode.eth_truncated", "shorter than an Ethernet header (or its VLAN tags)"),
    ("decode.ipv4_truncated", "IPv4 header or total length past the captured bytes"),
    ("decode.ipv4_bad_header", "IPv4 version or header length invalid"),
    ("decode.ipv4_fragment", "IPv4 fragment (RoCEv2 never fragments)"),
    ("decode.ipv6_truncated", "IPv6 header or payload length past the captured bytes"),
    ("decode.udp_truncated", "UDP header past the end of the IP payload"),
    ("decode.udp_bad_length", "UDP length disagrees with the IP payload"),
    ("decode.bth_truncated", "too short for BTH and ICRC"),
    ("decode.bth_unknown_opcode", "BTH opcode not defined for RoCEv2 (e.g. 0xaa)"),
    ("decode.ext_truncated", "the extended headers of the opcode do not fit"),
    ("decode.bad_padding", "pad count larger than the payload"),
    ("decode.icrc_bad", "the invariant CRC does not match: dropped, a retransmission is awaited"),
    ("decode.ipv6_bad_header", "IPv6 version field is not 6"),
    ("decode.payload_unexpected", "payload bytes after an opcode that carries none (ACK, READ request, ...)"),
    ("other.non_ip", "not IPv4 or IPv6 (ARP, LLDP, ...)"),
    ("other.non_udp", "IP but not UDP (TCP, ICMP, ...)"),
    ("other.non_roce", "UDP to a port other than 4791"),
    # stage 2: classification of RoCEv2 frames against the job
    ("other.unknown_flow", "RoCEv2 to a QP or address pair outside the job (p2p, CM, other jobs)"),
    ("other.ack", "RC acknowledgement (AETH)"),
    ("other.nak", "RC negative acknowledgement"),
    ("other.cnp", "congestion notification packet"),
    ("other.read_atomic", "RDMA READ or ATOMIC request/response"),
    ("other.send_ud", "SEND or UD datagram"),
    ("other.cts", "NCCL clear-to-send write of the job"),
    ("other.reduce_scatter", "reduce-scatter data of the job (partial sums; not needed: a frame in sequence "
                             "is not ICRC-checked in stage 2)"),
    ("data.before_lock", "job data before the stream locked on to an iteration boundary"),
    ("data.duplicate", "a PSN already received (retransmission or mirror duplicate)"),
    ("data.out_of_window", "a PSN outside the iterations being assembled"),
    ("data.opcode_mismatch", "opcode does not fit the packet's place in its planned write"),
    ("data.length_mismatch", "payload or RETH DMA length differs from the plan"),
    ("data.imm_mismatch", "ImmDt differs from the planned message size"),
    ("data.va_mismatch", "RETH address is not the planned FIFO slot"),
    ("data.flag_mismatch", "LL/LL128 flag is not the connection's step + 1"),
    ("data.written", "allgather data written to the gradient buffer"),
    # stage 1, GRE/ERSPAN encapsulation (appended: codes above keep their positions)
    ("decode.gre_truncated", "GRE header or its optional words past the end of the IP payload"),
    ("decode.gre_unsupported", "GRE version not 0, routing bit set, or a protocol other than ERSPAN"),
    ("decode.erspan_truncated", "ERSPAN header (or its platform subheader) past the end of the IP payload"),
    ("decode.erspan_bad_version", "ERSPAN version is not the GRE protocol's (1 for 0x88be, 2 for 0x22eb)"),
    ("decode.erspan_unsupported", "ERSPAN III frame type is not Ethernet (an IP packet without its frame)"),
    # stage 2, implausible or conflicting data (appended)
    ("data.implausible_psn", "PSN far from its flow's recent ones and out of sequence, or of an iteration past "
                             "the window without the pause that starts one"),
    ("data.duplicate_conflict", "allgather data already received (its PSN, or its block from another hop of this "
                                "stream) with other bytes: its blocks are not covered by this stream"),
    # before a wire plan exists (appended)
    ("other.unresolved", "a frame decoded while nccl.era or nccl.protocol 'auto' was still being read from the "
                         "wire, past the frames held for the parser (gradtap.parser.resolve)"),
    # the iteration's gradient shared by the streams (appended)
    ("data.set_aside", "allgather data whose bytes differ from the copy another stream wrote first: kept aside "
                       "for the merger's vote (gradtap.parser.aside)"),
    ("data.aside_full", "allgather data whose bytes differ from the copy another stream wrote first, with the "
                        "stream's set-aside area full: its blocks are disputed, covered by no stream"),
    ("data.unchecked", "allgather data of a unit another stream was still writing, with the stream's set-aside "
                       "area full: dropped uncompared; the claiming stream's copy covers the unit, this one not"),
)

NAMES = tuple(name for name, _ in EVENTS)
CODE = {name: i for i, name in enumerate(NAMES)}
N_EVENTS = len(EVENTS)

# Integer codes for kernels (module-level ints are compile-time constants in Numba), written
# out; tests/wire/test_events.py holds each equal to CODE.
DECODE_OK = 0
DECODE_FRAME_TRUNCATED = 1
DECODE_ETH_TRUNCATED = 2
DECODE_IPV4_TRUNCATED = 3
DECODE_IPV4_BAD_HEADER = 4
DECODE_IPV4_FRAGMENT = 5
DECODE_IPV6_TRUNCATED = 6
DECODE_UDP_TRUNCATED = 7
DECODE_UDP_BAD_LENGTH = 8
DECODE_BTH_TRUNCATED = 9
DECODE_BTH_UNKNOWN_OPCODE = 10
DECODE_EXT_TRUNCATED = 11
DECODE_BAD_PADDING = 12
DECODE_ICRC_BAD = 13
DECODE_IPV6_BAD_HEADER = 14
DECODE_PAYLOAD_UNEXPECTED = 15
OTHER_NON_IP = 16
OTHER_NON_UDP = 17
OTHER_NON_ROCE = 18
OTHER_UNKNOWN_FLOW = 19
OTHER_ACK = 20
OTHER_NAK = 21
OTHER_CNP = 22
OTHER_READ_ATOMIC = 23
OTHER_SEND_UD = 24
OTHER_CTS = 25
OTHER_REDUCE_SCATTER = 26
DATA_BEFORE_LOCK = 27
DATA_DUPLICATE = 28
DATA_OUT_OF_WINDOW = 29
DATA_OPCODE_MISMATCH = 30
DATA_LENGTH_MISMATCH = 31
DATA_IMM_MISMATCH = 32
DATA_VA_MISMATCH = 33
DATA_FLAG_MISMATCH = 34
DATA_WRITTEN = 35
DECODE_GRE_TRUNCATED = 36
DECODE_GRE_UNSUPPORTED = 37
DECODE_ERSPAN_TRUNCATED = 38
DECODE_ERSPAN_BAD_VERSION = 39
DECODE_ERSPAN_UNSUPPORTED = 40
DATA_IMPLAUSIBLE_PSN = 41
DATA_DUPLICATE_CONFLICT = 42
OTHER_UNRESOLVED = 43
DATA_SET_ASIDE = 44
DATA_ASIDE_FULL = 45
DATA_UNCHECKED = 46


def new_counters() -> np.ndarray:
    """A zeroed counter array indexed by event code (int64[N_EVENTS])."""
    return np.zeros(N_EVENTS, np.int64)


def as_dict(counters: np.ndarray, nonzero: bool = True) -> dict[str, int]:
    """Counters by event name."""
    return {NAMES[i]: int(v) for i, v in enumerate(counters) if v or not nonzero}
