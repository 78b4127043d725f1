"""The parser's fuzz tests again, with Numba's bounds checks on (``tests/core/boundscheck.py``):
stage 1's on plain frames (``test_decode_fuzz.py``) and on mirror encapsulations
(``test_erspan_fuzz.py``), and stage 2's (``test_stream_fuzz.py``, which runs only there). One
interpreter runs all three, so that the kernels they share compile with the checks once.
"""

from __future__ import annotations

import pytest
from numba import config

from tests.core.boundscheck import rerun_with_boundscheck

FILES = ("tests/parser/test_decode_fuzz.py", "tests/parser/test_erspan_fuzz.py", "tests/parser/test_stream_fuzz.py")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(bool(config.BOUNDSCHECK), reason="this is the subprocess")
def test_no_read_outside_a_frame_under_boundscheck():
    rerun_with_boundscheck(*FILES)      # test_decode_fuzz.py::test_boundscheck_is_on runs there
