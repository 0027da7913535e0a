"""Counts of what happened inside one task, per thread."""

from __future__ import annotations

import threading

from tierflow.system import tally


def test_add_counts_into_the_tally_open_on_this_thread_only() -> None:
    tally.add("halvings")  # none open: nothing to count into, no error
    seen: dict[str, int] = {}
    with tally.counting() as counts:
        tally.add("halvings")
        tally.add("spilled_bytes", 400)
        other = threading.Thread(target=lambda: tally.add("halvings", 5))
        other.start()
        other.join()
        seen = dict(counts)
    assert seen == {"halvings": 1, "spilled_bytes": 400}
    tally.add("halvings")
    assert counts == seen  # closed: nothing more counted


def test_a_nested_tally_counts_its_block_and_adds_it_to_the_outer_one() -> None:
    with tally.counting() as outer:
        tally.add("cache_hits")
        with tally.counting() as inner:
            tally.add("cache_hits", 2)
        assert inner == {"cache_hits": 2}
    assert outer == {"cache_hits": 3}
