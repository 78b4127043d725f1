"""Wire-format header layouts, one module per protocol (dpkt style).

Each module declares its header as a :class:`~gradtap.wire.headers.layout.Layout` table, cites the
specification section it follows, exports the derived offset/size/mask constants at module
level (``BTH_OFF_PSN``, ``BTH_PSN_MASK`` ...; naming in ``layout.py``) for Numba kernels, and
offers plain-Python ``pack(**fields) -> bytes`` / ``unpack(buf, offset=0) -> dict`` for tests,
the simulator and the CLI. ``opcodes`` holds the IBTA opcode table.
"""
