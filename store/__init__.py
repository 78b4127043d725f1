"""store: checkpoints at rest.

- :mod:`gradtap.store.snapshot`: atomic local snapshots (manifest committed last, sha256 of
  every file) that a trainer loads with ``torch.load``;
- :mod:`gradtap.store.object_store`: the durable tier, any fsspec URL (``file://``, ``s3://``),
  content-addressed objects and a READY manifest written last;
- :mod:`gradtap.store.uploader`: the background thread that takes snapshots to that tier,
  never on the update path.

See ``docs/store.md``.
"""
