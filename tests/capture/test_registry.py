"""The registry lists every source whatever the host; a source whose kernel feature or
privilege is missing still registers, and both its probe and its open say what is missing
and what to do."""

from __future__ import annotations

import errno
import os
import socket

import pytest

from gradtap.capture import af_packet, af_xdp
from gradtap.capture.registry import SOURCES, available, make_source, source_class
from gradtap.capture.source import COMMON_STATS, CaptureSource
from gradtap.core.errors import CaptureError, ConfigError


def test_every_source_is_registered_under_its_name():
    assert list(SOURCES) == ["pcap", "af_packet", "af_xdp"]
    for name, cls in SOURCES.items():
        assert issubclass(cls, CaptureSource) and cls.name == name and cls.summary
        assert cls.counter_names()[:2] == ("received", "kernel_drops")
        assert source_class(name) is cls


def test_an_unknown_source_lists_the_known_ones():
    with pytest.raises(ConfigError, match="'dpdk' is unknown; choose one of pcap, af_packet, af_xdp"):
        make_source("dpdk", "eth0")


def test_stats_hold_the_common_keys_and_the_published_counters(tmp_path):
    source = make_source("af_packet", "eth0")
    assert set(COMMON_STATS) <= set(source.stats()) and set(source.counter_names()) <= set(source.stats())
    source = make_source("af_xdp", "eth0")
    assert set(COMMON_STATS) <= set(source.stats()) and set(source.counter_names()) <= set(source.stats())


def test_without_privileges_live_sources_say_run_as_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    reasons = available()
    assert reasons["pcap"] is None
    for name in ("af_packet", "af_xdp"):
        assert "needs CAP_NET_RAW and CAP_NET_ADMIN: run gradtap as root" in reasons[name]
        with pytest.raises(CaptureError, match="run gradtap as root"):
            make_source(name, "eth0").open()


@pytest.mark.skipif(os.geteuid() != 0, reason="the probe checks privileges first")
def test_a_kernel_without_af_xdp_is_named(monkeypatch):
    real = socket.socket

    def refuse_af_xdp(family=-1, *args, **kwargs):
        if family == af_xdp.AF_XDP:
            raise OSError(errno.EAFNOSUPPORT, os.strerror(errno.EAFNOSUPPORT))
        return real(family, *args, **kwargs)
    monkeypatch.setattr(af_xdp.socket, "socket", refuse_af_xdp)
    message = ("af_xdp needs Linux >= 4.18 with CONFIG_XDP_SOCKETS; this kernel refused socket(AF_XDP): "
               "EAFNOSUPPORT; use the af_packet source instead")
    assert available()["af_xdp"] == message
    with pytest.raises(CaptureError) as error:
        make_source("af_xdp", "lo").open()
    assert str(error.value) == message


@pytest.mark.skipif(os.geteuid() != 0, reason="the probe checks privileges first")
def test_on_this_host_every_source_can_run():
    assert available() == {"pcap": None, "af_packet": None, "af_xdp": None}
    assert af_packet.AfPacketSource.probe() is None
