"""The sender's table of job transitions (``sender.job_states``) is the machine the
ledger enforces: every state and end reachable, the ends with no way out, an illegal
transition raising ``IllegalJobTransition``, and the ledger moving a job only through
the table."""

from __future__ import annotations

import pytest

from kv_connector.sender import job_states
from kv_connector.sender.job_states import JOBS, IllegalJobTransition, JobEnd, JobEvent, JobState, end, step
from tests.unit.sender.helpers import PAGE, ledger, post, submit, to_writing


def test_every_state_and_end_is_reachable_and_only_the_ends_are_terminal() -> None:
    assert JOBS.reachable() == set(JobState) | set(JobEnd)
    assert JOBS.terminal() == set(JobEnd)
    for e in JobEnd:
        assert JOBS.exits(e) == {}
    assert JOBS.exits(None) == {JobEvent.SUBMITTED: JobState.WAITING}


def test_every_live_job_can_be_acked_failed_or_lose_its_connection() -> None:
    for s in JobState:
        exits = JOBS.exits(s)
        assert exits[JobEvent.ACKED] is JobEnd.FINISHED and exits[JobEvent.FAILED] is JobEnd.FAILED
        assert exits[JobEvent.CONNECTION_LOST] is JobState.WAITING


def test_only_a_granted_job_posts_a_write_and_only_a_write_in_flight_ends() -> None:
    assert {s for s in JobState if JOBS.allows(s, JobEvent.WRITE_POSTED)} == {JobState.GRANTED}  # S2
    for event in (JobEvent.WRITE_COMPLETED, JobEvent.WRITE_FAILED):
        assert {s for s in JobState if JOBS.allows(s, event)} == {JobState.WRITING}


def test_an_illegal_transition_raises_and_names_it() -> None:
    with pytest.raises(IllegalJobTransition, match="a: write_posted is not allowed in state writing"):
        step(JobState.WRITING, JobEvent.WRITE_POSTED, "a")  # S4
    with pytest.raises(IllegalJobTransition, match="ends the job"):
        step(JobState.WRITTEN, JobEvent.ACKED, "a")
    with pytest.raises(IllegalJobTransition, match="does not end the job"):
        end(JobState.WAITING, JobEvent.REQUEST_SENT, "a")
    for e in JobEnd:
        for event in JobEvent:
            assert not JOBS.allows(e, event)  # type: ignore[arg-type]


def test_the_ledger_completes_a_write_only_through_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Take WRITING -> WRITTEN out of the table: a completed WRITE raises, and the job
    stays WRITING, nothing counted (nothing moved before the table said yes)."""
    rules = {k: v for k, v in JOBS.rules.items() if k != (JobState.WRITING, JobEvent.WRITE_COMPLETED)}
    monkeypatch.setattr(job_states.JOBS, "rules", rules)
    led = ledger()
    submit(led, "a")
    to_writing(led, "a")
    with pytest.raises(IllegalJobTransition, match="write_completed is not allowed in state writing"):
        led.write_completed("a", PAGE, 2.0)
    assert led.state_of("a") is JobState.WRITING and led.stats.bytes == 0


def test_a_write_is_posted_only_from_granted_as_the_table_says() -> None:
    led = ledger()
    submit(led, "a")
    with pytest.raises(IllegalJobTransition, match="write_posted is not allowed in state waiting"):
        post(led, "a", 0.0)
    assert led.state_of("a") is JobState.WAITING
