"""Where the golden inputs are: the real NCCL captures in ``shared/captures`` beside the repository.

CI clones the repository with ``shared/`` beside it, so the path is relative to this checkout;
``GRADTAP_CAPTURES`` overrides it. ``tests/test_golden_inputs.py`` fails when they are missing,
so no golden test can pass by not finding its input.
"""

import os
from pathlib import Path

CAPTURES = Path(os.environ.get("GRADTAP_CAPTURES", Path(__file__).resolve().parents[2] / "shared" / "captures"))
NAMES = ("allreduce+p2p.pcapng", "allreduce_addstep.pcapng", "iter_40000_p2p_iter10.pcapng",
         "iter_40000_p2p_iter10_3.pcapng", "rdma32.pcapng")
