"""Plain-Python twin of ``gradtap.merger.union.union``: block by block, byte strings, majority by
counting; in a tie, the streams outvoted on some other block of the bucket do not count."""

from collections import Counter


def union(block_ranges, copies):
    """``block_ranges``: [(start, nbytes)] in order; ``copies``: [(stream, bytes, [covered bool])].
    Returns (merged bytes with None for unknown blocks, covered list, mismatches as (block, sorted groups))."""
    values = [[(name, data[start:start + n]) for name, data, cov in copies if cov[j]]
              for j, (start, n) in enumerate(block_ranges)]
    outvoted = set()
    for vals in values:
        counts = Counter(v for _, v in vals)
        value, top = counts.most_common(1)[0] if vals else (None, 0)
        if len(counts) > 1 and top * 2 > len(vals):
            outvoted |= {name for name, v in vals if v != value}
    merged, covered, mismatches = [], [], []
    for j, vals in enumerate(values):
        if not vals:
            merged.append(None)
            covered.append(False)
            continue
        counts = Counter(v for _, v in vals)
        if len(counts) > 1:
            groups = sorted((tuple(name for name, v in vals if v == value) for value in counts),
                            key=len, reverse=True)
            mismatches.append((j, groups))
        value, top = counts.most_common(1)[0]
        if len(counts) > 1 and top * 2 <= len(vals):
            trusted = {v for name, v in vals if name not in outvoted}
            if len(trusted) != 1:
                merged.append(None)
                covered.append(False)
                continue
            (value,) = trusted
        merged.append(value)
        covered.append(True)
    return merged, covered, mismatches
