"""The decode events: stable dotted names, and the kernels' integer codes written out equal to them."""

from gradtap.wire import events


def test_every_event_has_its_written_out_code():
    for name, code in events.CODE.items():
        assert getattr(events, name.replace(".", "_").upper()) == code


def test_names_are_dotted_unique_and_codes_dense():
    assert len(set(events.NAMES)) == len(events.NAMES) == events.N_EVENTS
    assert all(name.count(".") == 1 and name == name.lower() for name in events.NAMES)
    assert sorted(events.CODE.values()) == list(range(events.N_EVENTS))
