"""The updater's tests compare with ``torch.sqrt`` and ``torch.optim``, so their process first
settles MKL's vector math on one thread, as the product's processes do
(``gradtap.core.vector_math``): a parallel first call could give one thread low-accuracy
roots, and a reproduced root would then look like none of this host's, its tests skipped."""

import pytest

from gradtap.core.vector_math import settle_vector_math


@pytest.fixture(autouse=True, scope="session")
def _settled_vector_math() -> None:
    settle_vector_math()
