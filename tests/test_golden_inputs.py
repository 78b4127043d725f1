"""The golden captures are where the tests look for them (a missing input fails here, loudly)."""

from tests.golden import CAPTURES, NAMES


def test_the_five_real_captures_are_present():
    missing = [n for n in NAMES if not (CAPTURES / n).is_file()]
    assert not missing, f"golden captures missing from {CAPTURES}: {missing} (set GRADTAP_CAPTURES)"
