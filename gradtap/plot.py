"""One PNG that shows what happened per iteration of a replay.

Top: the appliance's time per stage (parse, merge, update) for each iteration, stacked,
against the training's own iteration time (the budget the appliance must keep up with).
Bottom: the fraction of coverage blocks each mirror stream delivered, with unrecoverable
iterations marked.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on a mirror node
import matplotlib.pyplot as plt  # noqa: E402


def iteration_plot(path: Path, iterations: list[int], stage_s: dict[str, list[float]], iteration_s: list[float],
                   coverage: dict[str, list[float]], unrecoverable: list[int]) -> Path:
    """Write the plot to ``path``. ``stage_s``: stage -> seconds per iteration; ``iteration_s``:
    the training's iteration time; ``coverage``: stream -> fraction per iteration."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True, constrained_layout=True)
    bottom_of = [0.0] * len(iterations)
    for stage, seconds in stage_s.items():
        ms = [s * 1e3 for s in seconds]
        top.bar(iterations, ms, bottom=bottom_of, label=f"{stage}", width=0.7)
        bottom_of = [b + m for b, m in zip(bottom_of, ms)]
    top.plot(iterations, [s * 1e3 for s in iteration_s], "k--", marker="o", label="training iteration")
    top.set_ylabel("time per iteration (ms)")
    top.set_title("gradtap: appliance work per iteration vs the training's iteration time")
    top.legend(loc="upper right", fontsize=8)
    for stream, fractions in coverage.items():
        bottom.plot(iterations, [f * 100 for f in fractions], marker=".", label=stream)
    for i in unrecoverable:
        bottom.axvline(i, color="red", alpha=0.3)
    bottom.set_ylim(0, 105)
    bottom.set_ylabel("blocks delivered (%)")
    bottom.set_xlabel("iteration" + ("  (red: unrecoverable)" if unrecoverable else ""))
    bottom.legend(loc="lower right", fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
