"""The sender's job ledger: every request one rank ships, from submission to the reader's
``Ack`` or a named failure, as a state machine. Pure logic (no nixl, sockets, threads
or clocks: times are passed in). The shell (``kv_connector.sender.sender``) feeds it what
happened and performs what it answers; every transition is a method, and a transition
the state does not allow raises ``IllegalJobTransition`` (the shell's bug) or
``ProtocolError`` (the reader's: a Grant, Rewrite or Refuse that does not fit). The jobs
and failures are records of ``jobs.py``; what the ledger counts, ``stats.SenderMeter``.

A job's states (``JobState``: WAITING, REQUESTED, GRANTED, WRITING, WRITTEN), the ends
by which it leaves the ledger (finished, failed) and the one table of its legal
transitions are ``job_states.py``'s, which draws them; every transition goes through
that table (``job_states.step`` and ``end``), so a job never moves where the drawing does
not. The ledger decides which event happens, and when.

Failures: the reader refused the request; its WRITE failed ``max_write_attempts``
times; its checksum could not be computed; it waited ``connect_timeout_s`` for a working
reader (``expire``); the shell gave up on everything (``fail_all``).

Invariants (tests name the one they prove):
  S1  A job is in exactly one state; a finished or failed job leaves the ledger and is
      reported exactly once, with its reason.
  S2  No WRITE without a grant of the current connection: a WRITE is posted only from
      GRANTED, and a lost connection drops every grant.
  S3  A job is finished only by the reader's Ack, which the reader sends once it has
      the sample (all shares landed, or delivered before); an Ack that overtakes the
      completion of this rank's WRITE finishes the job when the WRITE completes, so the
      transport's handle is always settled before the blocks may be freed.
  S4  At most one WRITE of a job is in flight; a Rewrite that arrives while it is in
      flight is kept and honoured when it completes.
  S5  A job waits for a working reader at most ``connect_timeout_s``; every answer of
      the reader (a grant, an ack) starts the wait of every job again, and a completed
      WRITE its own job's.
  S6  With checksums on, every WRITE's notification carries the share's checksum or says
      it follows; a checksum that follows is sent on the connection its WRITE went out on,
      once, as soon as it is computed (a WRITE never waits for it); a checksum that cannot
      be computed fails the job.
  S7  A job granted pages and not acknowledged within the sample deadline fails, and
      the reader is told: a sample that cannot complete holds nobody's pages for long.
  S8  Once a preempted request's blocks are reused, no WRITE and no hash reads them: the
      shell waits (boundedly) for its share to be safely written, then ``freeze``s it;
      a job not safely written by then fails (the reader is told), and a Rewrite or a
      resend of a frozen job fails it too.
  S9  A job that fails holding a grant of the current connection (refused by the reader
      or failed here) fences it: once no WRITE of it is in flight (its handle settled by
      the shell), the reader gets ``Fenced`` with the grant's generation, and only then
      may give those pages to another sample. A Refuse of a job no longer here is
      ignored (it ended by itself; its own fence went out).
  S10 Only a job never requested or placed before is placed in a credit held ahead
      (``protocol.Credit``), the oldest first, in the first credit that holds it; when
      the oldest such job fits none, every credit is given back (the reader may need
      those pages for it). A lost connection drops every credit (S2), and a credit the
      reader recalls is given back unless a job was placed in it.
  S11 What the reader hears of a failed job never overtakes the job's own CreditRequest
      or Placed: a failure of a job whose message the shell has taken to send and not
      sent yet is parked (``park``) and handed back once it was sent (``announced``), so
      the reader never admits a sample after its refusal and holds its pages until the
      deadline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from kv_connector.common.errors import ConfigurationError
from kv_connector.sender.job_states import IllegalJobTransition, JobEvent, JobState, end, step
from kv_connector.sender.jobs import ChecksumState, Failure, FrozenJob, Job
from kv_connector.sender.stats import SenderMeter, SenderMetrics, SenderObservations, SenderStats
from kv_connector.wire import protocol
from kv_connector.wire.failure import FailureReason, SampleFailure
from kv_connector.wire.failure import refused as failure_reason_of
from kv_connector.wire.layout import pages_for
from kv_connector.wire.protocol import Credit, Grant, Manifest, ProtocolError, Refuse, Rewrite

# a WRITE that fails in NIXL is posted this many times in all
MAX_WRITE_ATTEMPTS = 3
# backoff before posting again (a gone reader's EOF arrives first)
WRITE_RETRY_S = 0.2


_PREEMPTED = "preempted before its share was safely written: its blocks are reused by another request"


class SendLedger:
    def __init__(
        self,
        checksum: bool = True,
        connect_timeout_s: float = 60.0,
        max_write_attempts: int = MAX_WRITE_ATTEMPTS,
        retry_backoff_s: float = WRITE_RETRY_S,
    ) -> None:
        if connect_timeout_s <= 0 or max_write_attempts <= 0 or retry_backoff_s < 0:
            raise ConfigurationError("connect_timeout_s and max_write_attempts must be positive")
        self.checksum = checksum
        self.connect_timeout_s = connect_timeout_s
        self.max_write_attempts = max_write_attempts
        self.retry_backoff_s = retry_backoff_s
        self._meter = SenderMeter()
        self.stats: SenderStats = self._meter.stats
        self._jobs: dict[str, Job] = {}
        self._finished: list[str] = []
        self._failed: dict[str, SampleFailure] = {}
        # held ahead, on the current connection (S10)
        self._credits: list[Credit] = []
        # taken to send a CreditRequest or Placed, not sent yet (S11)
        self._announcing: set[str] = set()
        # their failures, told once it was sent
        self._parked: dict[str, list[Failure]] = {}

    # ------------------------------------------------------------------ queries
    def __contains__(self, request_id: str) -> bool:
        return request_id in self._jobs

    def __len__(self) -> int:
        return len(self._jobs)

    def job(self, request_id: str) -> Job:
        try:
            return self._jobs[request_id]
        except KeyError:
            raise IllegalJobTransition(f"{request_id} is not in flight") from None

    def state_of(self, request_id: str) -> JobState | None:
        j = self._jobs.get(request_id)
        return None if j is None else j.state

    def jobs(self, *states: JobState) -> list[Job]:
        return [j for j in self._jobs.values() if not states or j.state in states]

    @property
    def unwritten(self) -> int:
        """Jobs whose blocks have not all landed in the reader yet."""
        return sum(j.state is not JobState.WRITTEN for j in self._jobs.values())

    @property
    def writing(self) -> bool:
        return any(j.state is JobState.WRITING for j in self._jobs.values())

    def take_finished(self) -> list[str]:
        """Request ids the reader acknowledged since the last call (S1, S3)."""
        out, self._finished = self._finished, []
        return out

    def take_failed(self) -> dict[str, SampleFailure]:
        """Request ids that failed since the last call, with the reason (S1)."""
        out, self._failed = self._failed, {}
        return out

    def metrics_mark(self) -> tuple[int, ...]:
        """A mark of what ``take_metrics`` reports: while it stays as it was right
        after the last take, there is nothing new (cheap enough to read every engine
        step; the shell reads it without its lock: ints read as they are)."""
        return self._meter.mark(len(self._jobs))

    def take_metrics(self) -> SenderMetrics:
        """For the metrics, at once: a snapshot of the counters, the observations since the
        last take, the jobs in flight, and the mark right after."""
        return self._meter.take(len(self._jobs))

    def take_observations(self) -> SenderObservations:
        """Each WRITE's latency and each grant's wait since the last call (at most
        ``observe.OBSERVATIONS_LIMIT`` of each are kept between calls)."""
        return self._meter.take_observations()

    # ------------------------------------------------- the shells' own counts
    def reconnected(self) -> None:
        """The shell connected to the reader again after a lost connection."""
        self.stats.reconnects += 1

    def hashed(self, seconds: float) -> None:
        """The shell's hashing thread took ``seconds`` to hash a share."""
        self.stats.checksum_s += seconds

    # ------------------------------------------------------------ caller events
    def submit(
        self, request_id: str, manifest: Manifest, block_ids: list[int], share: range, now: float
    ) -> Job:
        if request_id in self._jobs:
            raise ConfigurationError(f"{request_id} is already being shipped")
        state = step(None, JobEvent.SUBMITTED, request_id)
        job = Job(request_id, manifest, block_ids, share, t_submit=now, state=state, t_wait=now)
        if self.checksum and share:
            job.checksum_state = ChecksumState.NEEDED
        self._jobs[request_id] = job
        return job

    # ---------------------------------------------------------- shell events
    @property
    def credits(self) -> int:
        """Credits held ahead on the current connection."""
        return len(self._credits)

    def place_due(self, now: float, page_bytes: int) -> tuple[list[Job], list[int]]:
        """New jobs placed in credits held ahead (WAITING -> GRANTED, oldest first; the
        shell sends each a ``Placed``), and the generations of the credits to give back
        because the oldest job left fits none of them (S10)."""
        placed: list[Job] = []
        for j in self._jobs.values():
            if not self._credits:
                break
            if j.state is not JobState.WAITING or j.held or j.asked:
                continue
            m = j.manifest
            need = pages_for(m.geometry.sample_bytes(m.num_blocks), page_bytes)
            fit = next((c for c in self._credits if c.num_pages >= need), None)
            if fit is None:
                back = [c.generation for c in self._credits]
                self._credits.clear()
                return placed, back
            self._credits.remove(fit)
            j.state = step(j.state, JobEvent.PLACED, j.request_id)
            j.grant = Grant(
                request_id=j.request_id, first_page=fit.first_page, num_pages=need, generation=fit.generation
            )
            j.asked, j.t_granted = True, now
            self._meter.granted(now - j.t_submit)
            self.stats.placed += 1
            self._announcing.add(j.request_id)
            placed.append(j)
        return placed, []

    def requests_due(self) -> list[Job]:
        """WAITING jobs, oldest first: each gets a credit request now (WAITING ->
        REQUESTED). A job's checksum is computed once, whatever the connection."""
        due = [j for j in self._jobs.values() if j.state is JobState.WAITING and not j.held]
        for j in due:
            j.state = step(j.state, JobEvent.REQUEST_SENT, j.request_id)
            j.asked = True
            self._announcing.add(j.request_id)
        return due

    def park(self, failure: Failure) -> bool:
        """Keep ``failure`` if its job's CreditRequest or Placed is taken to send and not sent
        yet: True then, and the shell tells the reader nothing now (S11)."""
        if failure.request_id not in self._announcing:
            return False
        self._parked.setdefault(failure.request_id, []).append(failure)
        return True

    def announced(self, request_ids: Iterable[str]) -> list[Failure]:
        """The shell sent (or, its connection lost, gave up sending) these jobs' CreditRequest
        or Placed: the failures parked meanwhile, in order, to be told now (S11)."""
        out: list[Failure] = []
        for rid in request_ids:
            self._announcing.discard(rid)
            out += self._parked.pop(rid, [])
        return out

    def checksums_due(self) -> list[Job]:
        """Jobs whose share's checksum must be computed now (once per job, whatever the
        connection): NEEDED -> COMPUTING."""
        due = [j for j in self._jobs.values() if j.checksum_state is ChecksumState.NEEDED and not j.held]
        for j in due:
            j.checksum_state = ChecksumState.COMPUTING
        return due

    def hold(self, request_id: str, held: bool = True) -> None:
        """A held job waits in WAITING, neither requested nor hashed (its blocks may not be
        read yet), until ``hold(request_id, False)`` releases it."""
        job = self._jobs.get(request_id)
        if job is not None:
            job.held = held

    def checksum_ready(self, request_id: str, value: int) -> None:
        job = self._jobs.get(request_id)
        if job is None:
            # it failed meanwhile
            return
        if job.checksum_state is not ChecksumState.COMPUTING:
            raise IllegalJobTransition(f"{request_id}: a checksum it was not waiting for")
        job.checksum, job.checksum_state = value, ChecksumState.READY

    def checksums_owed(self) -> list[Job]:
        """Jobs whose WRITE went out saying the checksum follows, now that it is ready: the
        shell sends each a ``LateChecksum`` (S6)."""
        due = [j for j in self._jobs.values() if j.checksum_owed and j.checksum_state is ChecksumState.READY]
        for j in due:
            j.checksum_owed = False
        return due

    def checksum_failed(self, request_id: str, why: str) -> Failure | None:
        """The share's checksum could not be computed: the job fails (S6)."""
        job = self._jobs.get(request_id)
        if job is None:
            return None
        return self.fail(request_id, f"cannot checksum its blocks: {why}", FailureReason.OTHER)

    def writes_due(self, now: float) -> list[Job]:
        """GRANTED jobs whose WRITE may be posted now (backoff over); it does not wait for
        its checksum (S6). A job with an empty share has nothing to write: it is WRITTEN at
        once."""
        due = []
        for j in list(self._jobs.values()):
            if j.state is not JobState.GRANTED or now < j.retry_at:
                continue
            if not j.share:
                j.state = step(j.state, JobEvent.NOTHING_TO_WRITE, j.request_id)
                continue
            due.append(j)
        return due

    def notification(self, request_id: str) -> protocol.WriteDone:
        """What the next WRITE of the job announces: its grant's generation, and its
        checksum or that it follows. Only a GRANTED job has a next WRITE (S2)."""
        job = self.job(request_id)
        # IllegalJobTransition if not GRANTED
        step(job.state, JobEvent.WRITE_POSTED, request_id)
        return job.notification()

    def write_posting(self, request_id: str, now: float, notif: protocol.WriteDone) -> None:
        """GRANTED -> WRITING before the transport is called: the WRITE may land, and the
        reader ack it, before the call returns (S3: an Ack then waits for its completion)."""
        job = self.job(request_id)
        # only from GRANTED: S2, S4
        job.state = step(job.state, JobEvent.WRITE_POSTED, request_id)
        job.xfer, job.t_write = None, now
        job.checksum_owed = notif.checksum_follows

    def write_started(self, request_id: str, xfer: object, post_s: float = 0.0) -> bool:
        """The transport's handle of the WRITE being posted, whose post took ``post_s``.
        False if the job failed meanwhile: the shell polls the handle to its end itself."""
        self._meter.posted(post_s)
        job = self._jobs.get(request_id)
        if job is None or job.state is not JobState.WRITING or job.xfer is not None:
            return False
        job.xfer = xfer
        return True

    def write_posted(self, request_id: str, xfer: object, now: float, notif: protocol.WriteDone) -> None:
        """``write_posting`` and ``write_started`` at once."""
        self.write_posting(request_id, now, notif)
        self.write_started(request_id, xfer)

    def write_completed(self, request_id: str, nbytes: int, now: float) -> None:
        job = self.job(request_id)
        # only a WRITE in flight
        written = step(job.state, JobEvent.WRITE_COMPLETED, request_id)
        self._meter.written(nbytes, now - job.t_write)
        # progress: the wait starts again (S5)
        job.xfer, job.t_write, job.t_wait = None, now, now
        # S3: the reader acknowledged before this completion was polled
        if job.ack_due:
            self._finish(job, now)
        # S4: a Rewrite came while this WRITE was in flight
        elif job.rewrite_due:
            job.rewrite_due = False
            job.state = step(job.state, JobEvent.REWRITE, request_id)
            self.stats.rewrites += 1
        else:
            job.state = written

    def write_failed(self, request_id: str, error: str, now: float) -> Failure | None:
        """A WRITE failed inside the transport: posted again after a backoff, or, after
        ``max_write_attempts`` failures, the job fails (answer: tell the reader)."""
        job = self.job(request_id)
        # only a WRITE in flight
        retry = step(job.state, JobEvent.WRITE_FAILED, request_id)
        job.xfer = None
        # the reader has the sample: nothing is lost
        if job.ack_due:
            self._finish(job, now)
            return None
        job.attempts += 1
        if job.attempts < self.max_write_attempts:
            job.state = retry
            job.retry_at = now + self.retry_backoff_s * job.attempts
            self.stats.write_retries += 1
            return None
        return self.fail(
            request_id,
            f"its WRITE failed in NIXL {job.attempts} times (last: {error})",
            FailureReason.WRITE_FAILED,
        )

    # -------------------------------------------------------- reader messages
    def on_grant(self, grant: Grant, page_bytes: int, pool_bytes: int, now: float) -> None:
        """Pages for a REQUESTED job; a grant that does not fit the request or names
        pages outside the reader's pool is the reader's protocol error."""
        job = self._jobs.get(grant.request_id)
        if job is None or job.state is not JobState.REQUESTED:
            raise ProtocolError(f"grant for {grant.request_id}, which is not waiting")
        m = job.manifest
        if grant.num_pages != pages_for(m.geometry.sample_bytes(m.num_blocks), page_bytes):
            raise ProtocolError(f"grant of {grant.num_pages} pages does not fit {m.request_id}")
        if (grant.first_page + grant.num_pages) * page_bytes > pool_bytes:
            raise ProtocolError(f"grant for {m.request_id} names pages outside the reader's pool")
        job.state = step(job.state, JobEvent.GRANTED, grant.request_id)
        job.grant, job.t_granted = grant, now
        self._meter.granted(now - job.t_submit)
        self.reader_works(now)

    def on_credit(self, credit: Credit, page_bytes: int, pool_bytes: int) -> None:
        """A run of pages held ahead (S10); one outside the reader's pool, or one held
        already, is the reader's protocol error."""
        if (credit.first_page + credit.num_pages) * page_bytes > pool_bytes:
            raise ProtocolError(f"credit {credit.generation} names pages outside the reader's pool")
        if any(c.generation == credit.generation for c in self._credits):
            raise ProtocolError(f"credit {credit.generation} granted twice")
        self._credits.append(credit)
        self.stats.credits += 1

    def on_recall(self, generation: int) -> bool:
        """The reader wants credit ``generation`` back: True if it is held unused (the shell
        gives it back); False if a job was placed in it (its ``Placed`` answers) (S10)."""
        held = next((c for c in self._credits if c.generation == generation), None)
        if held is None:
            return False
        self._credits.remove(held)
        return True

    def give_back_credits(self) -> list[int]:
        """Every credit held unused, no longer held (the shell gives them back: it leaves)."""
        back = [c.generation for c in self._credits]
        self._credits.clear()
        return back

    def on_rewrite(self, msg: Rewrite) -> bool:
        """The reader's checksum of this rank's share failed: write it again into the same
        pages. True if a WRITE will follow because of it (False: one is due anyway)."""
        job = self._jobs.get(msg.request_id)
        if job is None or job.grant is None or not job.share:
            raise ProtocolError(f"rewrite of {msg.request_id}, which it was not granted")
        # its blocks hold another request's states now (S8): never rewrite
        if job.frozen:
            raise FrozenJob(msg.request_id)
        if job.state is JobState.WRITTEN:
            job.state = step(job.state, JobEvent.REWRITE, msg.request_id)
            self.stats.rewrites += 1
            return True
        if job.state is JobState.WRITING:
            # S4
            job.rewrite_due = True
            return True
        # GRANTED: its WRITE is due anyway
        return False

    def on_ack(self, request_id: str, now: float) -> bool:
        """The reader has the sample: the job is finished (S3), or, while its WRITE is in
        flight, once that completes. False (ignored) for a job not in flight."""
        job = self._jobs.get(request_id)
        if job is None:
            return False
        if job.state is JobState.WRITING:
            job.ack_due = True
        else:
            self._finish(job, now)
        self.reader_works(now)
        return True

    def _finish(self, job: Job, now: float) -> None:
        """The reader acked it (S3): it leaves the ledger, reported once."""
        end(job.state, JobEvent.ACKED, job.request_id)
        del self._jobs[job.request_id]
        self._finished.append(job.request_id)
        self._meter.acked(now - job.t_write)

    def on_refuse(self, msg: Refuse) -> Failure | None:
        """The reader refused one request (it fails, by name; its WRITE in flight and its
        grant go to the shell, S9), or the whole connection (a ProtocolError: the
        connection is lost, everything is resent after reconnecting). None: a request no
        longer here (it ended meanwhile)."""
        if not msg.request_id:
            raise ProtocolError(f"reader refused the connection ({msg.code}): {msg.message}")
        failure = self.fail(
            msg.request_id, f"reader refused ({msg.code}): {msg.message}", failure_reason_of(msg.code)
        )
        if failure is None:
            return None
        # it knows
        return dataclasses.replace(failure, tell_reader=False)

    # ------------------------------------------------------------- connection
    def writes_in_flight(self) -> list[Job]:
        return [j for j in self._jobs.values() if j.state is JobState.WRITING]

    def connection_lost(self, now: float) -> tuple[int, list[Failure]]:
        """Every job goes back to WAITING, its grant gone (S2); the shell has settled the
        WRITEs in flight first. A preempted job cannot be written again (S8): it fails.
        Returns how many jobs will be resent, and the failures."""
        self._credits.clear()
        for j in [j for j in self._jobs.values() if j.ack_due]:
            self._finish(j, now)
        for j in self._jobs.values():
            # the table allows it from any state
            step(j.state, JobEvent.CONNECTION_LOST, j.request_id)
            # WAITING, its grant gone
            j.connection_lost()
        frozen = [rid for rid, j in self._jobs.items() if j.frozen]
        why = _PREEMPTED + " (the connection was lost before the reader had it)"
        failures = [
            f
            for rid in frozen
            if (f := self.fail(rid, why, FailureReason.PREEMPTED, code="preempted")) is not None
        ]
        return len(self._jobs), failures

    def reader_works(self, now: float) -> None:
        """The reader answered correctly: no job is waiting for a working reader (one held
        back by credits is waiting for the trainer, which is not a fault) (S5)."""
        for j in self._jobs.values():
            j.t_wait = now

    def expire(self, now: float, why: str, address: str) -> list[Failure]:
        """Fail the jobs that waited ``connect_timeout_s`` for a working reader (S5)."""
        limit = self.connect_timeout_s
        late = [j.request_id for j in self._jobs.values() if now - j.t_wait > limit]
        out = []
        for rid in late:
            f = self.fail(
                rid,
                f"cannot reach the reader at {address} for {limit:.0f} s (last error: {why})",
                FailureReason.UNREACHABLE,
            )
            assert f is not None
            out.append(f)
        return out

    def fail(
        self, request_id: str, why: str, reason: FailureReason, code: protocol.RefuseCode = "write_failed"
    ) -> Failure | None:
        """The job fails with ``why`` for ``reason`` (S1); None if it is not in flight."""
        job = self._jobs.get(request_id)
        if job is None:
            return None
        end(job.state, JobEvent.FAILED, request_id)
        del self._jobs[request_id]
        self._failed[request_id] = SampleFailure(reason, why)
        xfer = job.xfer if job.state is JobState.WRITING else None
        # its poster fences it (S9)
        posting = job.state is JobState.WRITING and xfer is None
        generation = job.grant.generation if job.grant is not None and not posting else None
        return Failure(request_id, why, job.state is not JobState.WAITING, code, xfer, generation)

    def expire_granted(self, now: float, timeout: float) -> list[Failure]:
        """Fail the jobs granted ``timeout`` seconds ago and not acknowledged since: the
        reader holds their pages for a sample that cannot complete (S7)."""
        late = [
            j.request_id
            for j in self._jobs.values()
            if j.grant is not None and j.state is not JobState.WRITING and now - j.t_granted > timeout
        ]
        why = f"not acknowledged {timeout:.0f} s after its pages were granted"
        return [
            f for rid in late if (f := self.fail(rid, why, FailureReason.TIMEOUT, code="timeout")) is not None
        ]

    def unsafe(self, request_ids: Iterable[str]) -> list[str]:
        """Of ``request_ids``, the jobs whose share is not safely in the reader's pages yet:
        not written, or written but its checksum not taken (or a Rewrite due)."""
        return [rid for rid in request_ids if rid in self._jobs and not self._jobs[rid].safely_written]

    def freeze(self, request_ids: Iterable[str]) -> list[Failure]:
        """The requests were preempted and their blocks are reused from now on (S8): a job
        whose share is safely written lives on (the reader acks it), but nothing reads its
        blocks again (a Rewrite, or a resend after a lost connection, fails it); every
        other job fails now, a WRITE in flight with its handle for the shell to settle."""
        failures = []
        for rid in request_ids:
            job = self._jobs.get(rid)
            if job is None:
                continue
            job.frozen = True
            if not job.safely_written:
                f = self.fail(rid, _PREEMPTED, FailureReason.PREEMPTED, code="preempted")
                if f is not None:
                    failures.append(f)
        return failures

    def fail_all(self, why: str) -> list[Failure]:
        return [f for rid in list(self._jobs) if (f := self.fail(rid, why, FailureReason.OTHER)) is not None]
