"""RoCEv2 and NCCL on the wire: header tables, the ICRC, decode events, frame records, LL/LL128
line formats, the protocol and PSN arithmetic. Imported by the parser, the simulator and
inspect alike; it imports only ``gradtap.core``.
"""
