"""bench/emulated_report.py puts each moment an emulated device sits idle down to what its host
was doing then; the expected seconds below are worked out by hand from the intervals."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
try:
    import emulated_report
finally:
    sys.path.pop(0)

# device busy 0-1 and 2-3 in a window 0-4; the host receives 1-1.5, collects garbage 1.7-1.8,
# gathers (in a collective) 3.2-3.4
SPANS = [("F", 0.0, 1.0), ("I", 2.0, 3.0)]
WAITS = [("recv", 1.0, 1.5), ("gc2", 1.7, 1.8), ("all_gather_single", 3.2, 3.4)]


def test_idle_time_is_put_down_to_the_hosts_wait_then() -> None:
    causes = emulated_report.idle_causes(SPANS, WAITS, (0.0, 4.0))
    assert causes == pytest.approx(
        {
            "recv": 0.5,
            "host after recv": 0.2,  # 1.5-1.7: the host's own time right after the message
            "gc2": 0.1,
            "host": 0.2 + 0.2 + 0.6,  # 1.8-2.0, 3.0-3.2, 3.4-4.0
            "all_gather_single": 0.2,
        }
    )
    assert sum(causes.values()) == pytest.approx(2.0)  # the window less the busy time


def test_the_table_averages_the_ranks_and_splits_the_causes() -> None:
    row = {
        "row": "gpipe@pp2",
        "spans": {"0": SPANS, "1": [("F", 0.0, 4.0)]},  # rank 1 never idle
        "waits": {"0": WAITS, "1": []},
    }
    window, mean = emulated_report.mean_idle(row)
    assert window == pytest.approx(4.0)
    assert mean["recv"] == pytest.approx(0.25)
    table = emulated_report.idle_lines([row], mean=True)
    cells = [c.strip() for c in table[-1].strip("|").split("|")]
    assert cells[:2] == ["gpipe@pp2", "mean"]
    assert "(all_gather_single " in cells[4]
    shares = [float(c.split("%")[0]) for c in cells[2:]]
    # idle 1.0 s of 4 on average: receive 0.25, collective 0.1, collector 0.05, host right after
    # the receive 0.1, other host time 0.5
    assert shares == pytest.approx([25.0, 6.25, 2.5, 1.25, 2.5, 12.5], abs=0.06)
