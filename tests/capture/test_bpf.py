"""The XDP redirect program: its bytes equal the hand-checked encoding (what clang emits for
``return bpf_redirect_map(&xsks, ctx->rx_queue_index, XDP_PASS);`` once libbpf has put the
map fd in), the kernel's verifier accepts it with and without multi-buffer, a rejected
program's error carries the verifier's log, and the XSKMAP takes only XDP sockets."""

from __future__ import annotations

import os

import pytest

from gradtap.capture import bpf
from gradtap.core.errors import CaptureError

privileged = [pytest.mark.privileged, pytest.mark.skipif(os.geteuid() != 0, reason="bpf() needs root")]


def as_root(test):
    for mark in privileged:
        test = mark(test)
    return test


def test_program_bytes():
    expected = bytes.fromhex(
        "6112100000000000"      # r2 = *(u32 *)(r1 + 16)      ldxw, rx_queue_index
        "1811000007000000"      # r1 = map fd 7 ll (lddw, src = BPF_PSEUDO_MAP_FD)
        "0000000000000000"      #   (upper half of the immediate)
        "b703000002000000"      # r3 = 2 (XDP_PASS)           mov64 imm
        "8500000033000000"      # call 51 (bpf_redirect_map)
        "9500000000000000"      # exit
    )
    assert bpf.xsk_redirect_program(7) == expected


@pytest.mark.parametrize("frags", [False, True])
@as_root
def test_the_verifier_accepts_the_program(frags):
    map_fd = bpf.create_xskmap(4)
    try:
        prog_fd = bpf.load_xdp_program(bpf.xsk_redirect_program(map_fd), frags=frags)
        os.close(prog_fd)
    finally:
        os.close(map_fd)


@as_root
def test_a_rejected_program_reports_the_verifier_log():
    reads_r5 = bpf.insn(bpf.BPF_ALU64 | bpf.BPF_MOV | 0x08, bpf.R0, 5) + bpf.insn(bpf.BPF_JMP | bpf.BPF_EXIT)
    with pytest.raises(CaptureError, match=r"refused the XDP redirect program.*verifier log:(.|\n)*R5 !read_ok"):
        bpf.load_xdp_program(reads_r5, frags=False)


@as_root
def test_the_xskmap_takes_only_xdp_sockets():
    map_fd = bpf.create_xskmap(1)
    try:
        with pytest.raises(OSError):
            bpf.map_update(map_fd, 0, map_fd)          # a map fd is not an AF_XDP socket
    finally:
        os.close(map_fd)
