"""Global-norm gradient clipping with ``torch.nn.utils.clip_grad_norm_``'s exact rounding.

The trainer calls ``clip_grad_norm_(model.parameters(), max_norm)`` with its defaults
(torch 2.13, ``torch/nn/utils/clip_grad.py``): on the CPU each parameter's 2-norm comes from
``torch._foreach_norm``, the total is ``torch.linalg.vector_norm`` of their stack (in
parameter order), and every gradient is multiplied by
``clamp(max_norm / (total + 1e-6), max=1)``, a float32 0-d tensor. The coefficient is
computed here with those same torch calls, because the arithmetic is theirs: ``max_norm /
tensor`` is ``tensor.reciprocal() * max_norm`` in PyTorch (two roundings). The
per-parameter norms follow the summation order of ATen's reduction kernel
(``updater/norms.py``, which falls back to ``torch._foreach_norm`` on a host where it
differs). Both were checked to depend neither on the thread count nor on the alignment of
the gradient views.

The total needs every parameter's norm, so a clipped step can only be applied once the
last bucket of the iteration has arrived. Norms are taken bucket by bucket as gradients
arrive (:meth:`GradNorms.add`), which leaves only the stack, one small reduction and the
update itself for the end of the iteration.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from gradtap.core.errors import GradtapError
from gradtap.updater.norms import param_norms

NORM_TYPE = 2.0
CLIP_EPS = 1e-6     # clip_grad.py: max_norm / (total_norm + 1e-6)


class GradNorms:
    """The per-parameter gradient norms of one iteration, filled in any bucket order.

    ``n_params`` is the length of DDP's parameter list (the order ``model.parameters()``
    yields, which is the order the trainer stacks the norms in).
    """

    def __init__(self, n_params: int):
        self._values = np.zeros(n_params, np.float32)
        self._have = np.zeros(n_params, bool)

    def add(self, param_indices: Sequence[int], grad: np.ndarray, spans: np.ndarray) -> None:
        """Record the norms of the parameters ``param_indices``, whose gradients (float32,
        after any division by the world size) are ``grad[spans[k, 0]:spans[k, 1]]``
        (``updater/norms.py``: ``torch._foreach_norm``'s, on every core)."""
        spans = np.asarray(spans, np.int64).reshape(-1, 2)
        if len(param_indices) != len(spans):
            raise GradtapError(f"GradNorms.add: {len(param_indices)} indices for {len(spans)} gradients")
        self._put(param_indices, param_norms(grad, spans))

    def _put(self, param_indices: Sequence[int], values: Sequence[np.float32]) -> None:
        for i, value in zip(param_indices, values):
            if not 0 <= i < len(self._values):
                raise GradtapError(f"GradNorms: parameter {i} is not one of the {len(self._values)}")
            if self._have[i]:
                raise GradtapError(f"GradNorms: parameter {i} already has a norm this iteration")
            self._values[i], self._have[i] = value, True

    @property
    def missing(self) -> list[int]:
        """Parameters whose norm has not been added yet."""
        return np.flatnonzero(~self._have).tolist()

    def total(self) -> torch.Tensor:
        """The total norm, as ``torch.nn.utils.get_total_norm`` computes it (float32 0-d): the
        norm of the per-parameter norms stacked in parameter order."""
        missing = self.missing
        if missing:
            raise GradtapError(f"the total gradient norm needs every parameter; {len(missing)} are "
                               f"missing, starting with {missing[:5]}")
        return torch.linalg.vector_norm(torch.from_numpy(self._values), NORM_TYPE)

    def coefficient(self, max_norm: float) -> np.float32:
        """The factor ``clip_grad_norm_(..., max_norm)`` multiplies every gradient by."""
        clip_coef = float(max_norm) / (self.total() + CLIP_EPS)
        return np.float32(torch.clamp(clip_coef, max=1.0).item())
