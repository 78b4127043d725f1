"""store: checkpoints at rest.

- :mod:`gradtap.store.snapshot`: atomic local snapshots (manifest committed last, sha256 of
  every file) that a trainer loads with ``torch.load``;
- :mod:`gradtap.store.snapshot_writer`: those snapshots written by a background thread from
  pre-allocated copies of the replica's state, never on the update path;
- :mod:`gradtap.store.object_store`: the durable tier, any fsspec URL (``file://``, ``s3://``),
  content-addressed objects and a READY manifest written last;
- :mod:`gradtap.store.uploader`: the background thread that takes snapshots to that tier,
  never on the update path;
- :mod:`gradtap.store.gradient_log`: every applied iteration's gradient in that tier, and the
  replay that rebuilds any iteration since a snapshot (``gradtap restore --at``).

See ``docs/store.md``.
"""
