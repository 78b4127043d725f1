"""The live view of ``gradtap run``: rates between two statuses (``gradtap.status.RateWindow``)
and the table that shows them (``gradtap.tables.status_table``) in 80 columns."""

from rich.console import Console

from gradtap.status import ApplianceStatus, RateWindow
from gradtap.tables import status_table


def status(frames: dict[str, int], mbytes: int, cpu_us: dict[str, int], cpu_s: float) -> ApplianceStatus:
    capture = {name: {"frames": n, "bytes": mbytes * 1_000_000, "kernel_drops": 0, "ring_drops": 7,
                      **({"cpu_us": cpu_us[name]} if name in cpu_us else {})} for name, n in frames.items()}
    events = {n: {"data.written": 1_234_567, "data.duplicate": 3} for n in frames}
    return ApplianceStatus(capture=capture, events=events, recovered=12, unrecoverable=0, replica_iteration=13,
                           stale=False, lag_s=0.12, parse_s=1.0, merge_s=0.1, update_s=0.5,
                           locked={n: True for n in frames}, cpu_s=cpu_s)


def clock(*times: float):
    it = iter(times)
    return lambda: next(it)


def test_rates_are_the_counters_growth_over_the_time_between_two_statuses():
    window = RateWindow(clock(10.0, 12.5))
    assert window(status({"a": 1_000_000, "b": 50}, 100, {"a": 2_000_000, "b": 10}, 30.0)) is None
    r = window(status({"a": 1_750_000, "b": 50}, 4_100, {"a": 2_500_000, "b": 10}, 32.5))
    assert r.seconds == 2.5
    assert r.pps == {"a": 300_000.0, "b": 0.0}                  # 750,000 frames in 2.5 s
    assert r.bps == {"a": 8 * 4e9 / 2.5, "b": 8 * 4e9 / 2.5}    # 4,000 MB in 2.5 s
    assert r.capture_cores == {"a": 0.2, "b": 0.0}             # 0.5 core-s in 2.5 s
    assert r.appliance_cores == 1.0
    assert r.cores == 1.2
    assert abs(r.core_s_per_mframe - 1.2 / 0.3) < 1e-12        # 1.2 cores at 0.3 Mpps


def test_a_worker_without_cpu_time_a_restart_and_a_stalled_clock_give_no_false_rate():
    window = RateWindow(clock(0.0, 1.0, 1.0, 2.0))
    window(status({"a": 500, "b": 500}, 1, {"a": 100}, 1.0))
    r = window(status({"a": 200, "b": 900}, 1, {"a": 50}, 0.5))   # "a" restarted: its counters began again
    assert r.pps == {"a": 0.0, "b": 400.0} and r.capture_cores == {"a": 0.0} and r.appliance_cores == 0.0
    assert window(status({"a": 300, "b": 900}, 1, {"a": 60}, 0.6)) is None    # no time went by
    assert window(status({"a": 300, "b": 900}, 1, {"a": 60}, 0.6)).core_s_per_mframe is None   # no frame came


def render(table) -> list[str]:
    console = Console(width=80, record=True, force_terminal=False)
    console.print(table)
    return console.export_text().splitlines()


def test_the_live_view_fits_in_80_columns_with_a_row_per_stream():
    names = ["r0-egress", "r1-egress", "r2-egress"]
    window = RateWindow(clock(0.0, 0.5))
    window(status(dict.fromkeys(names, 8_000_000), 30_000, dict.fromkeys(names, 9_000_000), 40.0))
    now = status(dict.fromkeys(names, 8_150_000), 30_615, dict.fromkeys(names, 9_200_000), 40.9)
    for rates in (window(now), None):
        lines = render(status_table(now, rates))
        assert max(map(len, lines)) <= 80, lines
        rows = [line.split() for line in lines if line.split() and line.split()[0] in names]
        assert [r[0] for r in rows] == names, lines              # one line each: no cell folded
        if rates is None:
            assert rows[0] == ["r0-egress", "8,150,000", "-", "-", "-", "0", "7", "1,234,567", "3"]
        else:
            # 150,000 frames, 615 MB and 0.2 core-s in 0.5 s
            assert rows[0] == ["r0-egress", "8,150,000", "300", "9.8", "40", "0", "7", "1,234,567", "3"]
            caption = " ".join(" ".join(lines).split())
            # 0.9 s of the appliance's CPU and 3 x 0.2 of the workers' in 0.5 s, at 0.9 Mpps
            assert "the appliance: 1.80 cores parsing, merging and updating, 3.00 in all (3.33 per Mpps)" in caption
