"""RoCEv2 Congestion Notification Packet body, IBTA Annex A17 (RoCEv2) §A17.9.3.

A CNP is a BTH with opcode 0x81 and the congested QP as DestQP, followed by 16 reserved
bytes (then the ICRC).
"""

from gradtap.wire.headers.layout import Layout

CNP_BODY = Layout("CNP", "IBTA Annex A17 §A17.9.3", (
    ("reserved", "16s", b"\x00" * 16),
))

# Derived from the CNP_BODY table above and written out so that readers and linters see
# them; tests/wire/test_headers.py holds them equal to CNP_BODY.constants().
CNP_LEN = 16
CNP_OFF_RESERVED = 0
CNP_SIZE_RESERVED = 16

pack = CNP_BODY.pack
unpack = CNP_BODY.unpack
