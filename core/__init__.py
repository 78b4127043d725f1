"""The foundation every stage stands on: errors (``errors.py``), the Numba options and kernel
cache (``jit.py``), native memory operations (``memory.py``) and byte readers (``bytes.py``).

It imports no other gradtap package.
"""
