"""Packet sequence numbers: 24-bit serial numbers, IBTA Vol 1 Release 1.4 §9.7.1.

Every PSN sum and difference in gradtap goes through these functions, so the modulus is
derived once, from the BTH layout. They work on Python ints, NumPy integers and NumPy arrays
alike, and Numba kernels call them too (``register_jitable``: compiled into the kernel that
calls them, plain Python otherwise).
"""

from numba.extending import register_jitable

from gradtap.wire.headers.bth import BTH

PSN_MODULUS = (BTH.fields["psn"].mask >> BTH.fields["psn"].shift) + 1   # 2**24
PSN_MASK = PSN_MODULUS - 1
PSN_HALF = PSN_MODULUS // 2


@register_jitable
def psn_add(psn, n):
    """The PSN ``n`` packets after ``psn`` (``n`` may be negative), in ``[0, 2**24)``."""
    return (psn + n) % PSN_MODULUS


@register_jitable
def psn_ahead(base, psn):
    """How many packets ``psn`` lies after ``base`` going forward, in ``[0, 2**24)``."""
    return (psn - base) % PSN_MODULUS


@register_jitable
def psn_delta(base, psn):
    """The signed distance from ``base`` to ``psn``, in ``[-2**23, 2**23)``: positive when
    ``psn`` is less than half the sequence space ahead of ``base``."""
    return (psn - base + PSN_HALF) % PSN_MODULUS - PSN_HALF
