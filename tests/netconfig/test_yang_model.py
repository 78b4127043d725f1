"""The small YANG reader of ``yang_model.py`` on a module written here (it runs without SONiC's
model; ``test_sonic_yang.py`` runs it against SONiC's own model tests when that model is given)."""

from __future__ import annotations

import pytest

from tests.netconfig.yang_model import Model, parse, xpath

MODULE = """
module demo {
    yang-version 1.1;
    namespace "urn:demo"; prefix d;
    import ietf-inet-types { prefix inet; }
    typedef kind { type enumeration { enum A; enum "B"; } }
    container demo { container T { list T_LIST {
        key "name";
        leaf name { type string { pattern '[a-z]' + '[a-z0-9]{0,3}'; length 1..4; } }
        leaf kind { type kind; default "A"; }
        // a comment, /* and another */
        leaf ip { when "current()/../kind = 'A'"; type inet:ip-address; }
        leaf peer {
            when "current()/../kind = 'A'";
            must "(contains(current(), ':') and contains(../ip, ':')) or (not(contains(current(), ':')) and not(contains(../ip, ':')))" {
                error-message "same family";
            }
            type inet:ip-address;
        }
        leaf level { type uint8 { range "1..7|9" { error-message "bad level"; } } }
        leaf port { type union { type leafref { path "/p:ports/p:name"; } type string { pattern "CPU"; } } }
    } } }
}
"""
PORTS = {"/p:ports/p:name": {"e0"}}


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(parse(MODULE), ("demo", "T", "T_LIST"))


@pytest.mark.parametrize("entry,kind", [
    ({"name": "ab1"}, None),
    ({"name": "ab1", "ip": "10.0.0.1", "peer": "10.0.0.2", "level": "9", "port": "CPU"}, None),
    ({"name": "ab1", "port": "e0"}, None),
    ({"name": "1ab"}, "Pattern"),
    ({"name": "abcde"}, "Length"),
    ({"name": "ab", "kind": "C"}, "InvalidValue"),
    ({"name": "ab", "kind": "B", "ip": "10.0.0.1"}, "When"),
    ({"name": "ab", "ip": "10.0.0.1", "peer": "::1"}, "Must"),
    ({"name": "ab", "ip": "10.0.0"}, "InvalidValue"),
    ({"name": "ab", "level": "8"}, "Range"),
    ({"name": "ab", "level": "256"}, "Bounds"),
    ({"name": "ab", "port": "e1"}, "InvalidValue"),
    ({"name": "ab", "colour": "red"}, "Unknown"),
])
def test_leaves_are_checked_as_the_module_says(model, entry, kind):
    problems = model.check(entry, PORTS)
    assert [k for k, _ in problems] == ([] if kind is None else [kind]), problems


def test_messages_come_from_error_message(model):
    assert model.check({"name": "ab", "level": "8"}, PORTS) == [("Range", "bad level")]
    assert model.check({"name": "ab", "ip": "::2", "peer": "10.0.0.1"}, PORTS) == [("Must", "same family")]


def test_xpath_subset():
    entry = {"a": "x:y", "b": "z"}
    assert xpath("contains(current(), ':') and not(contains(../b, ':'))", entry, "a", {})
    assert not xpath("current()/../b = 'q' or (contains(../b, 'q'))", entry, "a", {})
    assert xpath("current()/../c = 'd'", entry, "a", {"c": "d"})
    with pytest.raises(ValueError, match="outside the supported subset"):
        xpath("count(../a) > 1", entry, "a", {})
