"""updater: reduced gradients in, a bit-exact replica of the trainer's optimizer state out.

- :mod:`updater.replica`: :class:`~updater.replica.Replica`, stepped bucket by bucket
  (``begin`` / ``apply_bucket`` / ``end``), with clipping, staleness and resync;
- :mod:`updater.kernels`: the Adam/AdamW Numba kernels, one per PyTorch implementation;
- :mod:`updater.mkl_sqrt`: PyTorch's (MKL's) float32 square root, reproduced;
- :mod:`updater.clipping`: ``clip_grad_norm_``'s coefficient;
- :mod:`updater.state`: the flat state and its PyTorch state dicts;
- :mod:`updater.selfcheck`: the start-up proof that this host's kernels equal its torch;
- :mod:`updater.snapshot`: atomic snapshots a trainer loads with ``torch.load``.

See ``docs/updater.md``.
"""
