"""Sequence numbers of a publisher's stream: in order, duplicates, gaps, restarts."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cache_service.core.engines.sequence import (
    RECONNECT_WINDOW,
    Decision,
    SequenceTracker,
    Verdict,
)


def test_the_first_number_starts_the_stream_and_names_the_history_missed() -> None:
    tracker = SequenceTracker()
    assert tracker.on_live(5) == Decision(Verdict.FIRST, 5, range(0, 5))
    assert tracker.on_replayed(5).verdict is Verdict.IN_ORDER
    assert tracker.on_live(6).verdict is Verdict.IN_ORDER


def test_history_replayed_after_the_first_number_is_applied_in_order() -> None:
    tracker = SequenceTracker()
    tracker.on_live(3)
    verdicts = [tracker.on_replayed(seq).verdict for seq in (0, 1, 2, 3, 4)]
    assert verdicts == [Verdict.IN_ORDER] * 5
    assert tracker.on_live(4).verdict is Verdict.DUPLICATE  # replay already had it
    assert tracker.on_live(5).verdict is Verdict.IN_ORDER


def test_a_gap_names_the_missing_range_and_waits_for_replay() -> None:
    tracker = SequenceTracker()
    tracker.on_live(0)
    tracker.on_replayed(0)
    assert [tracker.on_live(seq).verdict for seq in (1, 2)] == [Verdict.IN_ORDER] * 2
    decision = tracker.on_live(6)
    assert decision == Decision(Verdict.GAP, 6, range(3, 6))
    assert [tracker.on_replayed(seq).verdict for seq in (3, 4, 5, 6, 7)] == [Verdict.IN_ORDER] * 5
    assert tracker.on_replayed(6).verdict is Verdict.DUPLICATE  # the held live message
    assert tracker.on_live(7).verdict is Verdict.DUPLICATE
    assert tracker.on_live(8).verdict is Verdict.IN_ORDER


def test_a_gap_replay_cannot_fill_is_accepted_once_and_reported() -> None:
    tracker = SequenceTracker()
    tracker.on_live(0)
    tracker.on_replayed(0)
    assert tracker.on_live(4).verdict is Verdict.GAP
    assert tracker.on_replayed(4) == Decision(Verdict.GAP, 4, range(1, 4))
    assert tracker.on_live(5).verdict is Verdict.IN_ORDER


def test_zero_after_any_number_is_a_restart() -> None:
    tracker = SequenceTracker()
    tracker.on_live(0)
    tracker.on_replayed(0)
    tracker.on_live(1)
    assert tracker.on_live(0) == Decision(Verdict.RESTART, 0, range(0))
    assert tracker.on_replayed(0).verdict is Verdict.IN_ORDER
    assert tracker.on_live(1).verdict is Verdict.IN_ORDER


def test_far_below_is_a_restart_and_just_below_is_a_duplicate() -> None:
    tracker = SequenceTracker(duplicate_window=10)
    tracker.on_live(100)
    tracker.on_replayed(100)
    assert tracker.on_live(95).verdict is Verdict.DUPLICATE
    assert tracker.on_live(50) == Decision(Verdict.RESTART, 50, range(0, 50))


def test_any_step_back_after_a_reconnect_is_a_restart() -> None:
    tracker = SequenceTracker(duplicate_window=10)
    tracker.on_live(100)
    tracker.on_replayed(100)
    tracker.note_reconnect()
    assert tracker.on_live(98).verdict is Verdict.RESTART


def test_a_reconnect_without_a_step_back_is_an_ordinary_number() -> None:
    tracker = SequenceTracker()
    tracker.on_live(0)
    tracker.on_replayed(0)
    tracker.note_reconnect()
    assert tracker.on_live(1).verdict is Verdict.IN_ORDER


def test_the_old_publishers_queued_messages_do_not_hide_the_restart_after_them() -> None:
    """After a reconnect the old publisher's last queued numbers may come first; the new
    publisher's low numbers after them are still its restart, not duplicates."""
    tracker = SequenceTracker(duplicate_window=1024)
    tracker.on_live(100)
    tracker.on_replayed(100)
    tracker.note_reconnect()
    for seq in (101, 102):  # still queued from the old publisher
        assert tracker.on_live(seq).verdict is Verdict.IN_ORDER
    assert tracker.on_live(5).verdict is Verdict.RESTART


def test_the_reconnect_window_closes_after_enough_ordinary_numbers() -> None:
    tracker = SequenceTracker(duplicate_window=1024)
    tracker.on_live(0)
    tracker.on_replayed(0)
    tracker.note_reconnect()
    for seq in range(1, RECONNECT_WINDOW + 2):
        assert tracker.on_live(seq).verdict is Verdict.IN_ORDER
    assert tracker.on_live(RECONNECT_WINDOW - 5).verdict is Verdict.DUPLICATE


@given(st.lists(st.booleans(), min_size=1, max_size=60))
def test_with_replay_every_number_is_applied_exactly_once_in_order(lost: list[bool]) -> None:
    """A stream 0..n-1 where some live messages are lost and replay fills every gap."""
    tracker = SequenceTracker()
    applied: list[int] = []
    for seq, is_lost in enumerate(lost):
        if is_lost:
            continue
        decision = tracker.on_live(seq)
        if decision.verdict is Verdict.IN_ORDER:
            applied.append(seq)
        elif decision.verdict is not Verdict.DUPLICATE:
            for missing in decision.missing:
                if tracker.on_replayed(missing).verdict is Verdict.IN_ORDER:
                    applied.append(missing)
            assert tracker.on_replayed(seq).verdict is Verdict.IN_ORDER
            applied.append(seq)
    sent = [seq for seq, is_lost in enumerate(lost) if not is_lost]
    expected = list(range(sent[-1] + 1)) if sent else []
    assert applied == expected


def test_history_asked_at_connection_then_live_numbers_it_held_are_duplicates() -> None:
    tracker = SequenceTracker()
    assert [tracker.on_history(seq).verdict for seq in (0, 1, 2)] == [Verdict.IN_ORDER] * 3
    # Published while the history was replayed: read live too, even 0.
    assert [tracker.on_live(seq).verdict for seq in (0, 1, 2)] == [Verdict.DUPLICATE] * 3
    assert tracker.on_live(3).verdict is Verdict.IN_ORDER


def test_past_the_history_a_step_back_to_zero_is_a_restart_again() -> None:
    tracker = SequenceTracker()
    for seq in range(51):
        tracker.on_history(seq)
    for seq in range(51, 2000):
        assert tracker.on_live(seq).verdict is Verdict.IN_ORDER
    assert tracker.on_live(0).verdict is Verdict.RESTART


def test_starting_over_forgets_every_number_and_the_same_publisher_closes_the_window() -> None:
    tracker = SequenceTracker()
    tracker.on_live(0)
    tracker.on_replayed(0)
    tracker.on_live(1)
    tracker.note_reconnect()
    tracker.note_same_publisher()  # the reconnected publisher is the one before
    assert tracker.on_live(1).verdict is Verdict.DUPLICATE  # not a restart
    tracker.start_over()
    assert (tracker.last_live, tracker.last_applied) == (None, None)
    assert tracker.on_history(0).verdict is Verdict.IN_ORDER
