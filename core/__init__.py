"""The foundation every stage stands on: errors, the Numba options, native memory operations.

It imports no other gradtap package.
"""
