"""UsageMeter: CPU % from two looks at a job's processes, whatever was born, reused or found late between them."""

from backend.jobs.usage import CLOCK_TICKS, _cpu_pct, _Look


def look(at: float, boot_ticks: int, ticks: dict) -> _Look:
    return _Look(at, boot_ticks, ticks)


def test_cpu_percent_counts_growth_births_and_not_late_finds_or_reused_pids():
    before = look(10.0, 1000, {(1, 500): 100, (2, 600): 50})
    now = look(12.0, 1000 + 2 * CLOCK_TICKS, {(1, 500): 100 + CLOCK_TICKS, (3, 1100): CLOCK_TICKS // 2, (4, 700): 999, (2, 1050): 10})
    # pid 1 used one second of CPU; pid 3 (born between the looks) half a second; pid 4 (older, found late) and the
    # reused pid 2 (new start time, born between) count only what they did since birth: 0 and 10 ticks.
    expected = 100.0 * (CLOCK_TICKS + CLOCK_TICKS // 2 + 10) / CLOCK_TICKS / 2.0
    assert _cpu_pct(before, now) == expected
    assert _cpu_pct(None, now) is None and _cpu_pct(now, now) is None  # one look, or no time between two: no CPU %
