"""RoCEv2 and NCCL on the wire: header tables (``headers/``), the ICRC (``icrc.py``), decode
events (``events.py``), frame records (``frame_record.py``), the LL and LL128 line formats
(``ll.py``, ``ll128.py``), the protocol (``protocol.py``) and PSN arithmetic (``psn.py``).
Imported by the parser, the simulator and inspect alike; it imports only ``gradtap.core``.
"""
