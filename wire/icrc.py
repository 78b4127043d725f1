"""The RoCEv2 invariant CRC (ICRC): a zlib CRC-32 over the masked packet, Numba-callable.

What is covered (IBTA Vol 1 Release 1.4 §7.8 "CRCs", RoCEv2 Annex A17; cross-checked with the
Linux rxe driver, ``drivers/infiniband/sw/rxe/rxe_icrc.c``, ``rxe_icrc_hdr``):

1. eight 0xFF bytes standing for InfiniBand's masked LRH (rxe seeds its CRC with the state
   after them, 0xdebb20e3; here that is ``ICRC_SEED`` in zlib convention);
2. the IP header with its variant fields set to all ones:
   IPv4 TOS (DSCP+ECN), TTL and header checksum; IPv6 traffic class, flow label and hop
   limit (rxe: ``priority = 0xf``, ``flow_lbl`` all 0xff, ``hop_limit = 0xff``, which leaves
   only the version nibble);
3. the UDP header with its checksum set to all ones;
4. the BTH with byte 4 (FECN, BECN and 6 reserved bits; rxe's ``resv8a``) set to 0xFF;
5. the extension headers and payload, pad bytes included, up to the ICRC itself.

The CRC is the zlib one (reflected 0x04C11DB7, init and final xor all ones) and is stored
little-endian in the last 4 bytes of the IP/UDP payload, before the Ethernet FCS (captures
carry no FCS). The masking matches scapy 2.8.0 ``scapy/contrib/roce.py`` ``BTH.compute_icrc``.

Speed: the CRC runs in ISA-L's ``crc32_gzip_refl`` (PCLMULQDQ folding), which the pinned
``isal`` wheel exports from its ``isal_zlib`` extension module. Its semantics equal
``zlib.crc32(data, value)`` exactly (same init/final inversion, chainable), which the tests
check. Kernels call it through ``numba.types.ExternalFunction`` by symbol name after
``llvmlite`` has loaded that module: unlike a ctypes function object (whose address Numba
would bake in as a "dynamic global"), a by-name call keeps the calling kernels cacheable
(``cache=True`` in ``gradtap.core.jit``). With ``NUMBA_DISABLE_JIT=1`` the same functions run as
Python and call ISA-L through ctypes. On a host with 256-bit ``vpclmulqdq`` and AVX2, runs of
whole 128-byte blocks are folded by gradtap's own (``wire/crc_fold.py``: twice ISA-L's rate on
AMD EPYC Zen 3, where ISA-L has no kernel for it, for data in cache, the same from memory; on
an AVX-512 Xeon a sixth faster than ISA-L's 512-bit kernel from memory, a quarter slower in
cache) and the rest continues in ISA-L.

The payload's own CRC comes with the ICRC at no extra pass (:func:`icrc_and_payload_crc`): the
CRC of a concatenation is the first part's CRC shifted by the second part's length, xored with
the second part's CRC (zlib's ``crc32_combine``, zlib 1.2.12 ``crc32.c``: ``multmodp(x2nmodp(len2,
3), crc1) ^ crc2``, the shift being a product with x^(8 len2) modulo the polynomial). The shift
is linear in the CRC's 32 bits, so for a fixed length it is four table lookups, one per byte of
the CRC (:data:`CRC_SHIFT`). A RoCE data packet's payload is almost always a whole path MTU
(256, 512, 1024, 2048 or 4096 bytes): an RDMA WRITE of L bytes is ``divUp(L, MTU)`` packets,
all full but the last (``docs/wire-format.md``, from IBTA Vol 1 §9.7, and the captures), so
the tables are made for those five lengths only; any other length is CRC'd in one pass as
before, without a payload CRC. The parser compares two streams' copies of a packet by this CRC
instead of reading the copy already stored (``parser/assemble.py``).

Preconditions (the callers, i.e. the parser kernels, validate them; these functions do not):
``buf`` is a C-contiguous 1-D uint8 array; the IP header at ``l3_offset`` is complete and of
the stated family (IPv4: its IHL is 5..15), UDP follows it directly, a full BTH follows UDP,
and ``l3_offset + ip_header_len + 8 + 12 <= end - 4``, ``end <= len(buf)``. Out-of-range
offsets make ISA-L read outside ``buf``.
"""

import ctypes
import zlib

import isal.isal_zlib
import llvmlite.binding
import numpy as np
from llvmlite import ir
from numba import config, njit, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.arrayobj import make_array, populate_array

from gradtap.core.jit import JIT
from gradtap.wire.crc_fold import BLOCK as FOLD_BLOCK, FOLDS, MIN_BLOCKS as FOLD_MIN_BLOCKS, fold_crc32
from gradtap.wire.headers import eth, ipv4, ipv6, udp
from gradtap.wire.headers.bth import BTH_BECN_MASK, BTH_FECN_MASK, BTH_LEN, BTH_OFF_FECN, \
    BTH_RESV6_MASK, BTH_SIZE_FECN
from gradtap.wire.headers.ipv4 import IPPROTO_UDP, IPV4_CHECKSUM_MASK, IPV4_DSCP_MASK, \
    IPV4_ECN_MASK, IPV4_IHL_MASK, IPV4_IHL_SHIFT, IPV4_OFF_CHECKSUM, IPV4_OFF_DSCP, \
    IPV4_OFF_IHL, IPV4_OFF_TTL, IPV4_SIZE_CHECKSUM, IPV4_SIZE_DSCP, IPV4_SIZE_TTL, \
    IPV4_TTL_MASK
from gradtap.wire.headers.ipv6 import IPV6_DSCP_MASK, IPV6_ECN_MASK, IPV6_FLOW_LABEL_MASK, \
    IPV6_HOP_LIMIT_MASK, IPV6_LEN, IPV6_OFF_DSCP, IPV6_OFF_HOP_LIMIT, IPV6_SIZE_DSCP, \
    IPV6_SIZE_HOP_LIMIT
from gradtap.wire.headers.udp import ROCEV2_UDP_PORT, UDP_CHECKSUM_MASK, UDP_LEN, \
    UDP_OFF_CHECKSUM, UDP_SIZE_CHECKSUM

ICRC_LEN = 4
# zlib-convention CRC state after the eight 0xFF bytes of the masked LRH.
ICRC_SEED = zlib.crc32(b"\xff" * 8)

# The path MTUs an InfiniBand or RoCE port may run: 256 to 4096 bytes, powers of two.
ROCE_MTUS = (256, 512, 1024, 2048, 4096)
_CRC_POLY = 0xEDB88320     # zlib's polynomial, reflected: bit 31 is the coefficient of x^0


def _product_mod_poly(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial, both in the reflected representation."""
    product = 0
    for i in range(32):
        if a & (1 << (31 - i)):         # a holds x^i
            product ^= b
        b = (b >> 1) ^ (_CRC_POLY if b & 1 else 0)     # b times x
    return product


def _x_power(e: int) -> int:
    """x^e modulo the CRC polynomial (reflected), by squaring."""
    result, base = 1 << 31, 1 << 30
    while e:
        if e & 1:
            result = _product_mod_poly(result, base)
        base = _product_mod_poly(base, base)
        e >>= 1
    return result


def _shift_tables(nbytes: int) -> np.ndarray:
    """uint32[4, 256]: row j, entry v, is ``(v << 8 j) * x^(8 nbytes)`` modulo the polynomial,
    so that xoring one entry per byte of a CRC shifts it past ``nbytes`` bytes."""
    k = _x_power(8 * nbytes)
    basis = np.array([_product_mod_poly(1 << i, k) for i in range(32)], np.uint32)
    v = np.arange(256)
    tables = np.zeros((4, 256), np.uint32)
    for j in range(4):
        for bit in range(8):
            tables[j] ^= np.where(v & (1 << bit), basis[8 * j + bit], np.uint32(0)).astype(np.uint32)
    return tables


#: ``CRC_SHIFT[m]``: the shift tables (:func:`_shift_tables`) past ``ROCE_MTUS[m]`` bytes.
CRC_SHIFT = np.stack([_shift_tables(n) for n in ROCE_MTUS])

# Largest masked prefix: IPv4 at its largest IHL (60 bytes, 40 of options), UDP, BTH.
_IPV4_MAX_LEN = (IPV4_IHL_MASK >> IPV4_IHL_SHIFT) * 4
_PREFIX_MAX = _IPV4_MAX_LEN + UDP_LEN + BTH_LEN

# Variant bits, all within one big-endian word each.
_IPV4_TOS_ONES = IPV4_DSCP_MASK | IPV4_ECN_MASK
_IPV6_TCFL_ONES = IPV6_DSCP_MASK | IPV6_ECN_MASK | IPV6_FLOW_LABEL_MASK
_BTH_RESV8A_ONES = BTH_FECN_MASK | BTH_BECN_MASK | BTH_RESV6_MASK

_ISAL_LIBRARY = isal.isal_zlib.__file__
_ISAL_SYMBOL = "crc32_gzip_refl"

if config.DISABLE_JIT:
    _isal_ctypes = getattr(ctypes.CDLL(_ISAL_LIBRARY), _ISAL_SYMBOL)
    _isal_ctypes.restype = ctypes.c_uint32
    _isal_ctypes.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint64]

    def _isal_crc32(crc, address, length):
        return np.uint32(_isal_ctypes(int(crc), int(address), int(length)))

    def _prefix_buffer():
        return np.empty(_PREFIX_MAX, np.uint8)
else:
    llvmlite.binding.load_library_permanently(_ISAL_LIBRARY)
    # uint32 crc32_gzip_refl(uint32 init, const uint8 *buf, uint64 len); the pointer is
    # declared as uintp (same register class in the x86-64 ABI) so kernels pass
    # ``arr.ctypes.data + start``.
    _isal_crc32 = types.ExternalFunction(
        _ISAL_SYMBOL, types.uint32(types.uint32, types.uintp, types.uint64))

    @intrinsic
    def _prefix_buffer(typingctx):
        """A ``_PREFIX_MAX``-byte uint8 array on the caller's stack. The masked prefix is
        built per frame; a heap array there made a 1102-byte frame cost 66 ns instead of
        45 ns (measured in cache)."""
        sig = types.Array(types.uint8, 1, "C")()

        def codegen(context, builder, signature, args):
            storage = cgutils.alloca_once(builder, ir.ArrayType(ir.IntType(8), _PREFIX_MAX))
            out = make_array(signature.return_type)(context, builder)
            populate_array(out, data=builder.bitcast(storage, ir.IntType(8).as_pointer()),
                           shape=[cgutils.intp_t(_PREFIX_MAX)], strides=[cgutils.intp_t(1)],
                           itemsize=cgutils.intp_t(1), meminfo=None)
            return out._getvalue()

        return sig, codegen


@njit(**JIT)
def crc32_update(crc, buf, start, stop):
    """``zlib.crc32(buf[start:stop], crc)`` as a uint32, without copying: in ISA-L, whole
    128-byte blocks first folded on 256-bit vectors where this host takes that path
    (``wire/crc_fold.py``; Numba drops the branch where it does not).

    ``buf``: C-contiguous 1-D uint8 array; requires ``0 <= start <= stop <= len(buf)``.
    """
    crc = np.uint32(crc)
    blocks = (stop - start) // FOLD_BLOCK
    if FOLDS and blocks >= FOLD_MIN_BLOCKS:
        crc = fold_crc32(crc, buf, start, blocks)
        start += blocks * FOLD_BLOCK
    return _isal_crc32(crc, buf.ctypes.data + np.int64(start), np.uint64(stop - start))


@njit(**JIT, inline="always")
def _set_ones(pre, offset, size, mask):
    """OR ``mask`` into the ``size``-byte big-endian word at ``pre[offset]``."""
    for k in range(size):
        pre[offset + k] |= (mask >> (8 * (size - 1 - k))) & 0xFF


@njit(**JIT, inline="always")
def _masked_prefix(buf, l3_offset, l3_is_ipv6, pre):
    """Copy the packet's IP, UDP and BTH headers into ``pre`` with their variant fields
    masked to ones; returns their length."""
    if l3_is_ipv6:
        ip_len = IPV6_LEN
    else:
        ihl = (np.int64(buf[l3_offset + IPV4_OFF_IHL]) & IPV4_IHL_MASK) >> IPV4_IHL_SHIFT
        ip_len = ihl * 4
    n = ip_len + UDP_LEN + BTH_LEN
    for k in range(n):
        pre[k] = buf[l3_offset + k]
    if l3_is_ipv6:
        _set_ones(pre, IPV6_OFF_DSCP, IPV6_SIZE_DSCP, _IPV6_TCFL_ONES)
        _set_ones(pre, IPV6_OFF_HOP_LIMIT, IPV6_SIZE_HOP_LIMIT, IPV6_HOP_LIMIT_MASK)
    else:
        _set_ones(pre, IPV4_OFF_DSCP, IPV4_SIZE_DSCP, _IPV4_TOS_ONES)
        _set_ones(pre, IPV4_OFF_TTL, IPV4_SIZE_TTL, IPV4_TTL_MASK)
        _set_ones(pre, IPV4_OFF_CHECKSUM, IPV4_SIZE_CHECKSUM, IPV4_CHECKSUM_MASK)
    _set_ones(pre, ip_len + UDP_OFF_CHECKSUM, UDP_SIZE_CHECKSUM, UDP_CHECKSUM_MASK)
    _set_ones(pre, ip_len + UDP_LEN + BTH_OFF_FECN, BTH_SIZE_FECN, _BTH_RESV8A_ONES)
    return n


@njit(**JIT, inline="always")
def crc32_shift(crc, mtu):
    """``crc`` (zlib convention) shifted past ``ROCE_MTUS[mtu]`` bytes: xored with the CRC of
    those bytes alone, it is the CRC of the concatenation."""
    c = np.int64(crc)
    return (np.int64(CRC_SHIFT[mtu, 0, c & 0xFF]) ^ np.int64(CRC_SHIFT[mtu, 1, (c >> 8) & 0xFF]) ^
            np.int64(CRC_SHIFT[mtu, 2, (c >> 16) & 0xFF]) ^ np.int64(CRC_SHIFT[mtu, 3, (c >> 24) & 0xFF]))


@njit(**JIT, inline="always")
def _mtu_index(nbytes):
    """The index in ``ROCE_MTUS`` of a path MTU of ``nbytes``, else -1."""
    for m in range(len(ROCE_MTUS)):
        if nbytes == ROCE_MTUS[m]:
            return m
    return -1


@njit(**JIT)
def icrc_frame(buf, l3_offset, l3_is_ipv6, end):
    """The ICRC (uint32) of the RoCEv2 packet whose IP header starts at ``buf[l3_offset]``
    and whose ICRC field is ``buf[end - 4:end]``.

    The masked IP/UDP/BTH prefix is built in a stack buffer; the CRC then continues over
    the extension headers and payload straight from ``buf``. Compare the result with the
    little-endian uint32 stored at ``end - 4``. See the module docstring for the
    preconditions on the offsets (not checked here).
    """
    pre = _prefix_buffer()
    n = _masked_prefix(buf, l3_offset, l3_is_ipv6, pre)
    crc = crc32_update(ICRC_SEED, pre, 0, n)
    return crc32_update(crc, buf, l3_offset + n, end - ICRC_LEN)


@njit(**JIT)
def icrc_and_payload_crc(buf, l3_offset, l3_is_ipv6, payload_off, payload_len, end):
    """``(icrc, payload_crc)``: :func:`icrc_frame`'s ICRC, and ``zlib.crc32`` of the
    ``payload_len`` bytes at ``buf[payload_off]`` (the payload: after the extension headers,
    before the pad) when that length is a RoCE path MTU, else -1. One pass over the payload
    either way. Besides :func:`icrc_frame`'s preconditions: ``payload_off`` is at or after the
    BTH's end and ``payload_off + payload_len <= end - 4``."""
    mtu = _mtu_index(payload_len)
    if mtu < 0:
        return np.int64(icrc_frame(buf, l3_offset, l3_is_ipv6, end)), np.int64(-1)
    pre = _prefix_buffer()
    n = _masked_prefix(buf, l3_offset, l3_is_ipv6, pre)
    crc = crc32_update(ICRC_SEED, pre, 0, n)
    if payload_off > l3_offset + n:
        crc = crc32_update(crc, buf, l3_offset + n, payload_off)
    payload = np.int64(crc32_update(0, buf, payload_off, payload_off + payload_len))
    crc = crc32_shift(crc, mtu) ^ payload
    if payload_off + payload_len < end - ICRC_LEN:
        crc = crc32_update(crc, buf, payload_off + payload_len, end - ICRC_LEN)
    return np.int64(crc), payload


def locate_icrc(frame) -> tuple[int, bool, int]:
    """``(l3_offset, l3_is_ipv6, end)`` of the RoCEv2 packet in an Ethernet frame.

    Walks Ethernet, any 802.1Q/802.1ad tags, IPv4 (unfragmented) or IPv6, and UDP to port
    4791; ``end`` is where the UDP datagram (ICRC included) ends. Raises ``ValueError``
    saying what is missing when the frame is not a complete RoCEv2 packet.
    """
    frame = bytes(frame)
    offset = eth.ETH_LEN
    if len(frame) < offset:
        raise ValueError(f"frame of {len(frame)} bytes is shorter than an Ethernet header")
    ethertype = eth.unpack(frame)["type"]
    while ethertype in (eth.ETHERTYPE_VLAN, eth.ETHERTYPE_QINQ):
        ethertype = eth.unpack_vlan(frame, offset)["type"]
        offset += eth.VLAN_LEN
    l3 = offset
    if ethertype == eth.ETHERTYPE_IPV4:
        ip = ipv4.unpack(frame, l3)
        if ip["version"] != 4 or ip["ihl"] < 5 or ip["proto"] != IPPROTO_UDP:
            raise ValueError(f"IPv4 header at {l3} is not a UDP header of valid length: {ip}")
        if ip["frag_offset"] or ip["flags"] & 1:
            raise ValueError(f"IPv4 packet at {l3} is a fragment")
        l4 = l3 + ip["ihl"] * 4
    elif ethertype == eth.ETHERTYPE_IPV6:
        ip = ipv6.unpack(frame, l3)
        if ip["version"] != 6 or ip["next_header"] != IPPROTO_UDP:
            raise ValueError(f"IPv6 header at {l3} is not followed by UDP: {ip}")
        l4 = l3 + IPV6_LEN
    else:
        raise ValueError(f"ethertype {ethertype:#06x} is neither IPv4 nor IPv6")
    u = udp.unpack(frame, l4)
    if u["dport"] != ROCEV2_UDP_PORT:
        raise ValueError(f"UDP destination port {u['dport']} is not RoCEv2's {ROCEV2_UDP_PORT}")
    end = l4 + u["length"]
    if u["length"] < UDP_LEN + BTH_LEN + ICRC_LEN or end > len(frame):
        raise ValueError(f"UDP length {u['length']} at {l4} does not fit BTH + ICRC in a "
                         f"{len(frame)}-byte frame")
    return l3, ethertype == eth.ETHERTYPE_IPV6, end


def compute_icrc(frame) -> int:
    """The ICRC a correct sender would store in this Ethernet frame (an int < 2**32)."""
    l3, is_ipv6, end = locate_icrc(frame)
    return int(icrc_frame(np.frombuffer(bytes(frame), np.uint8), l3, is_ipv6, end))


def icrc_ok(frame) -> bool:
    """Whether the ICRC stored in this RoCEv2 Ethernet frame is correct."""
    l3, is_ipv6, end = locate_icrc(frame)
    frame = bytes(frame)
    stored = int.from_bytes(frame[end - ICRC_LEN:end], "little")
    return int(icrc_frame(np.frombuffer(frame, np.uint8), l3, is_ipv6, end)) == stored
