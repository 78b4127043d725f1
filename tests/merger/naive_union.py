"""Plain-Python twin of ``gradtap.merger.union.union``: block by block, byte strings, majority by counting."""

from collections import Counter


def union(block_ranges, copies):
    """``block_ranges``: [(start, nbytes)] in order; ``copies``: [(stream, bytes, [covered bool])].
    Returns (merged bytes with None for unknown blocks, covered list, mismatches as (block, sorted groups))."""
    merged, covered, mismatches = [], [], []
    for j, (start, n) in enumerate(block_ranges):
        values = [(name, data[start:start + n]) for name, data, cov in copies if cov[j]]
        if not values:
            merged.append(None)
            covered.append(False)
            continue
        counts = Counter(v for _, v in values)
        if len(counts) > 1:
            groups = sorted((tuple(name for name, v in values if v == value) for value in counts),
                            key=len, reverse=True)
            mismatches.append((j, groups))
        value, top = counts.most_common(1)[0]
        if len(counts) > 1 and top * 2 <= len(values):
            merged.append(None)
            covered.append(False)
            continue
        merged.append(value)
        covered.append(True)
    return merged, covered, mismatches
