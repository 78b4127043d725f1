"""Global-norm gradient clipping with ``torch.nn.utils.clip_grad_norm_``'s exact rounding.

The trainer calls ``clip_grad_norm_(model.parameters(), max_norm)`` with its defaults
(torch 2.13, ``torch/nn/utils/clip_grad.py``): on the CPU each parameter's 2-norm comes from
``torch._foreach_norm``, the total is ``torch.linalg.vector_norm`` of their stack (in
parameter order), and every gradient is multiplied by
``clamp(max_norm / (total + 1e-6), max=1)``, a float32 0-d tensor. The coefficient is
computed here with those same torch calls, because the arithmetic is theirs: ``max_norm /
tensor`` is ``tensor.reciprocal() * max_norm`` in PyTorch (two roundings), and the norm's
summation order belongs to ATen's reduction kernels. Both were checked to depend neither
on the thread count nor on the alignment of the gradient views.

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

NORM_TYPE = 2.0
CLIP_EPS = 1e-6     # clip_grad.py: max_norm / (total_norm + 1e-6)


class GradNorms:
    """The per-parameter gradient norms of one iteration, filled in any bucket order.

    ``n_params`` is the length of DDP's parameter list (the order ``model.parameters()``
    yields, which is the order the trainer stacks the norms in).
    """

    def __init__(self, n_params: int):
        self._norms: list[torch.Tensor | None] = [None] * n_params

    def add(self, param_indices: Sequence[int], grads: Sequence[np.ndarray]) -> None:
        """Record the norms of the parameters ``param_indices``, whose gradients (float32,
        after any division by the world size) are ``grads``."""
        if len(param_indices) != len(grads):
            raise GradtapError(f"GradNorms.add: {len(param_indices)} indices for {len(grads)} gradients")
        norms = torch._foreach_norm([torch.from_numpy(g) for g in grads], NORM_TYPE)
        for i, norm in zip(param_indices, norms):
            if self._norms[i] is not None:
                raise GradtapError(f"GradNorms.add: parameter {i} already has a norm this iteration")
            self._norms[i] = norm

    @property
    def missing(self) -> list[int]:
        """Parameters whose norm has not been added yet."""
        return [i for i, n in enumerate(self._norms) if n is None]

    def total(self) -> torch.Tensor:
        """The total norm, as ``torch.nn.utils.get_total_norm`` computes it (float32 0-d)."""
        missing = self.missing
        if missing:
            raise GradtapError(f"the total gradient norm needs every parameter; {len(missing)} are "
                               f"missing, starting with {missing[:5]}")
        return torch.linalg.vector_norm(torch.stack(self._norms), NORM_TYPE)  # type: ignore[arg-type]

    def coefficient(self, max_norm: float) -> np.float32:
        """The factor ``clip_grad_norm_(..., max_norm)`` multiplies every gradient by."""
        clip_coef = float(max_norm) / (self.total() + CLIP_EPS)
        return np.float32(torch.clamp(clip_coef, max=1.0).item())
