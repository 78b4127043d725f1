"""updater: reduced gradients in, a bit-exact replica of the trainer's optimizer state out.

- :mod:`gradtap.updater.replica`: :class:`~updater.replica.Replica`, stepped bucket by bucket
  (``begin`` / ``apply_bucket`` / ``end``), with clipping, staleness and resync (``offer``);
- :mod:`gradtap.updater.kernels`: the Adam/AdamW Numba kernels, one per PyTorch implementation;
- :mod:`gradtap.updater.mkl_sqrt`: PyTorch's (MKL's) float32 square roots, reproduced (AVX-512, SSE);
- :mod:`gradtap.updater.clipping`: ``clip_grad_norm_``'s coefficient;
- :mod:`gradtap.updater.state`: the flat state and its PyTorch state dicts;
- :mod:`gradtap.updater.selfcheck`: the start-up proof that this host's kernels equal its torch;
- :mod:`gradtap.updater.replica_origin`: what a replica started from (its snapshots carry it).

Its snapshots, and their tiers, are ``store/``'s.

See ``docs/updater.md``.
"""
