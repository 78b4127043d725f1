"""The ``bpf()`` system call, an XSKMAP, and the XDP program that feeds an AF_XDP socket.

No clang and no libbpf: the program is five instructions (six 8-byte slots), encoded here from the
instruction-set definitions (``linux/bpf_common.h``, ``linux/bpf.h``;
``Documentation/bpf/standardization/instruction-set.rst``)::

    r2 = *(u32 *)(r1 + offsetof(struct xdp_md, rx_queue_index))
    r1 = map_fd ll                  ; 16-byte load of the XSKMAP (BPF_PSEUDO_MAP_FD)
    r3 = XDP_PASS                   ; what to do if no socket sits at that queue
    call bpf_redirect_map           ; -> XDP_REDIRECT into the socket of this rx queue
    exit

the redirect that libxdp's default AF_XDP program performs on kernels >= 5.3, where the
low bits of ``flags`` give the action for a missing entry. Frames of a queue with no socket
go on to the normal stack.

``bpf_attr`` is a union whose members are passed as a zero-padded byte block; each command
here packs the leading fields it needs (``linux/bpf.h``).
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

from gradtap.core.errors import CaptureError

#: __NR_bpf per architecture (arch/*/entry/syscalls, include/uapi/asm-generic/unistd.h).
SYSCALL_BPF = {"x86_64": 321, "aarch64": 280, "arm64": 280, "riscv64": 280, "ppc64le": 361, "s390x": 351}

BPF_MAP_CREATE, BPF_MAP_UPDATE_ELEM, BPF_PROG_LOAD = 0, 2, 5
BPF_MAP_TYPE_XSKMAP = 17
BPF_PROG_TYPE_XDP = 6
BPF_F_XDP_HAS_FRAGS = 1 << 5      # the program accepts multi-buffer frames (Linux >= 5.18)
BPF_PSEUDO_MAP_FD = 1
BPF_FUNC_redirect_map = 51
XDP_PASS = 2
XDP_MD_RX_QUEUE_INDEX = 16        # offsetof(struct xdp_md, rx_queue_index)
_ATTR_BYTES = 128                 # larger than every bpf_attr member used here
_OBJ_NAME_LEN = 16

# Opcode parts (linux/bpf_common.h, linux/bpf.h).
BPF_LD, BPF_LDX, BPF_JMP, BPF_ALU64 = 0x00, 0x01, 0x05, 0x07
BPF_W, BPF_DW = 0x00, 0x18
BPF_IMM, BPF_MEM = 0x00, 0x60
BPF_K = 0x00
BPF_MOV, BPF_CALL, BPF_EXIT = 0xB0, 0x80, 0x90
R0, R1, R2, R3 = range(4)


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    """One 8-byte instruction: opcode, dst/src registers (4 bits each), offset, immediate."""
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def xsk_redirect_program(map_fd: int) -> bytes:
    """The program above, bound to the XSKMAP ``map_fd``."""
    return b"".join((
        insn(BPF_LDX | BPF_MEM | BPF_W, R2, R1, XDP_MD_RX_QUEUE_INDEX),
        insn(BPF_LD | BPF_IMM | BPF_DW, R1, BPF_PSEUDO_MAP_FD, imm=map_fd),
        insn(0),                                  # second half of the 64-bit immediate
        insn(BPF_ALU64 | BPF_MOV | BPF_K, R3, imm=XDP_PASS),
        insn(BPF_JMP | BPF_CALL, imm=BPF_FUNC_redirect_map),
        insn(BPF_JMP | BPF_EXIT),
    ))


_libc = ctypes.CDLL(None, use_errno=True)


def bpf(cmd: int, attr: bytearray) -> int:
    """``bpf(cmd, &attr, len(attr))``; the result (an fd or 0), or OSError with the errno."""
    machine = platform.machine()
    if machine not in SYSCALL_BPF:
        raise CaptureError(f"the bpf() system call number for {machine} is not known to gradtap "
                           f"(known: {', '.join(SYSCALL_BPF)})")
    buf = (ctypes.c_char * len(attr)).from_buffer(attr)
    ret = _libc.syscall(SYSCALL_BPF[machine], cmd, buf, len(attr))
    if ret < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return ret


def _name(text: str) -> bytes:
    return text.encode()[:_OBJ_NAME_LEN - 1].ljust(_OBJ_NAME_LEN, b"\0")


def create_xskmap(entries: int, name: str = "gradtap_xsks") -> int:
    """A new XSKMAP (u32 queue index -> AF_XDP socket) of ``entries`` slots; its fd."""
    attr = bytearray(_ATTR_BYTES)
    # map_type, key_size, value_size, max_entries, map_flags, inner_map_fd, numa_node, map_name
    struct.pack_into("<7I16s", attr, 0, BPF_MAP_TYPE_XSKMAP, 4, 4, entries, 0, 0, 0, _name(name))
    try:
        return bpf(BPF_MAP_CREATE, attr)
    except OSError as exc:
        raise CaptureError(f"af_xdp: creating the XSKMAP failed: {exc.strerror}; AF_XDP needs Linux >= 4.18 "
                           f"with CONFIG_BPF_SYSCALL and CONFIG_XDP_SOCKETS, run as root") from exc


def map_update(map_fd: int, key: int, value: int) -> None:
    """Set ``map[key] = value`` (u32 key and value) in a BPF map."""
    k, v = ctypes.c_uint32(key), ctypes.c_uint32(value)
    attr = bytearray(_ATTR_BYTES)
    struct.pack_into("<IIQQQ", attr, 0, map_fd, 0, ctypes.addressof(k), ctypes.addressof(v), 0)
    bpf(BPF_MAP_UPDATE_ELEM, attr)


def load_xdp_program(code: bytes, *, frags: bool, name: str = "gradtap_xsk") -> int:
    """Load ``code`` as an XDP program (license GPL: bpf_redirect_map is GPL-only); its fd.
    ``frags``: declare it multi-buffer aware (frames larger than a page). A verifier
    rejection raises CaptureError with the verifier's log."""
    insns = ctypes.create_string_buffer(code, len(code))
    license_ = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(1 << 16)
    attr = bytearray(_ATTR_BYTES)
    # prog_type, insn_cnt, insns, license, log_level, log_size, log_buf, kern_version,
    # prog_flags, prog_name
    struct.pack_into("<IIQQIIQII16s", attr, 0, BPF_PROG_TYPE_XDP, len(code) // 8, ctypes.addressof(insns),
                     ctypes.addressof(license_), 1, len(log), ctypes.addressof(log), 0,
                     BPF_F_XDP_HAS_FRAGS if frags else 0, _name(name))
    try:
        return bpf(BPF_PROG_LOAD, attr)
    except OSError as exc:
        verifier = log.value.decode(errors="replace").strip()
        raise CaptureError(f"af_xdp: the kernel refused the XDP redirect program: {exc.strerror}"
                           + (f"; verifier log:\n{verifier}" if verifier else "")) from exc
