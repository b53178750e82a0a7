"""The reader's metrics from its ledger: counters per producer, the pool's pages by what
holds them, refusals by reason, hand-out latency; the Prometheus text made of them.
Pure: the ledger, no transport."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kv_connector.files.metrics import FilesCollector
from kv_connector.files.stats import FileStats
from kv_connector.reader.push.ledger import ReaderLedger
from kv_connector.reader.push.metrics import ReaderCollector
from kv_connector.reader.push.records import CheckShare
from kv_connector.reader.push.stats import PoolState, ReaderStats
from kv_connector.wire import protocol
from tests.unit.reader.push.helpers import (
    PAGE,
    connected,
    credit,
    done,
    hand_out,
    hello,
    land,
    ledger,
    manifest,
    sends,
)


def scrape(*collectors: object) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The Prometheus text of ``collectors``, parsed back: (sample name, labels) -> value."""
    reg = CollectorRegistry()
    for c in collectors:
        reg.register(c)  # type: ignore[arg-type]
    text = generate_latest(reg).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


class LedgerView:
    """What ``HiddenStatesReader`` answers, straight from a ledger."""

    def __init__(self, led: ReaderLedger) -> None:
        self.led = led

    def stats(self) -> ReaderStats:
        return self.led.stats.snapshot()

    def pool_state(self) -> PoolState:
        return self.led.view.pool_state()

    def producers_connected(self) -> dict[str, int]:
        return self.led.view.producers_connected()


def test_the_pool_state_counts_pages_by_what_holds_them() -> None:
    led = ledger(pages=10)
    assert ReaderLedger().view.pool_state() == PoolState()  # no page size yet
    connected(led, (1, hello()))
    led.credit_request(1, credit("leased", 40), 0.0)  # 3 pages each
    led.credit_request(1, credit("ready", 40), 0.0)
    led.credit_request(1, credit("granted", 40), 0.0)
    led.credit_request(1, credit("waits", 40), 0.0)  # 1 page left: it waits
    land(led, 1, "leased")
    land(led, 1, "ready")
    hand_out(led, ("p", "leased"))
    assert led.view.pool_state() == PoolState(PAGE, 10, free=1, granted=6, leased=3, quarantined=0, waiting=1)
    assert led.stats.peak_pages_used == 9
    led.peer_gone(1, 0.0)
    led.tick(1.0)  # grace over: the producer's incomplete sample is discarded (quarantined)
    s = led.view.pool_state()
    assert (s.granted, s.leased, s.quarantined) == (3, 3, 3)  # "ready" is still granted
    assert s.free + s.granted + s.leased + s.quarantined == s.num_pages
    assert led.stats.dropped == 2  # "granted", and "waits" (cancelled: it never had pages)


def test_hand_outs_are_counted_by_producer_with_their_latency() -> None:
    led = ledger(pages=8)
    connected(led, (1, hello("p")), (2, hello("q")))
    for peer, pid, rid, n in ((1, "p", "a", 40), (2, "q", "b", 5), (1, "p", "c", 16)):
        led.credit_request(peer, credit(rid, n), 1.0)
        land(led, peer, rid)
        hand_out(led, (pid, rid), now=1.5)
        led.release((pid, rid), 2.0)
    st = led.stats.snapshot()
    token = manifest("a", 1).geometry.token_bytes  # the ledger counts a sample's states
    assert (st.samples, st.tokens, st.bytes) == (3, 61, 61 * token)
    assert {k: (v.samples, v.tokens, v.bytes) for k, v in st.by_producer.items()} == {
        "p": (2, 56, 56 * token),
        "q": (1, 5, 5 * token),
    }
    assert st.handout_latency.count == 3 and st.handout_latency.total == pytest.approx(1.5)
    assert (st.first_request_t, st.last_handout_t) == (1.0, 1.5)
    led.stats.by_producer["p"].samples += 1
    assert st.by_producer["p"].samples == 2  # a snapshot does not move


def test_refusals_are_counted_by_reason() -> None:
    led = ledger(pages=2, max_rewrites=0)
    connected(led, (1, hello()))
    sends(led.credit_request(1, credit("huge", 100), 0.0), protocol.Refuse)
    led.credit_request(1, credit("bad", 16), 0.0)
    land(led, 1, "bad", checksum=None)  # no checksum from a host cache: refused (unchecked)
    led.credit_request(1, credit("worse", 1), 0.0)
    actions = led.write_done(1, done(led, 1, "worse", checksum=7))
    (v,) = [a for a in actions if isinstance(a, CheckShare)]
    led.share_checked(v.key, v.rank, v.landing, False, 0.0)  # past max_rewrites at once: refused
    led.credit_request(1, credit("late", 1), 0.0)
    led.tick(100.0)  # the quarantines end: "late" is granted now
    led.tick(1e6)  # never written: refused at its deadline
    st = led.stats
    assert (st.refused_pool_too_small, st.refused_checksum, st.refused_unchecked) == (1, 1, 1)
    assert (st.refused_timeout, st.refused, st.samples_refused) == (1, 4, 4)
    assert (st.checksum_mismatches, st.dropped) == (1, 3)


def test_the_prometheus_text_says_what_the_ledger_holds() -> None:
    led = ledger(pages=8)
    connected(led, (1, hello("p")), (2, hello("q", rank=0, world=2)))
    led.credit_request(1, credit("a", 40), 0.0)
    land(led, 1, "a")
    hand_out(led, ("p", "a"), now=0.02)
    for _ in range(3):  # three connections refused by the serving thread
        led.refused_peer()
    files = FileStats(files=1, bytes=1234)
    files.fsync.observe(0.003)
    m = scrape(ReaderCollector(LedgerView(led)), FilesCollector(lambda: files))
    p = (("producer", "p"),)
    assert m[("hidden_states_reader_samples_received_total", p)] == 1
    assert m[("hidden_states_reader_tokens_received_total", p)] == 40
    assert m[("hidden_states_reader_received_bytes_total", p)] == 40 * manifest("a", 40).geometry.token_bytes
    assert m[("hidden_states_reader_pool_pages", (("state", "leased"),))] == 3
    assert m[("hidden_states_reader_pool_pages", (("state", "free"),))] == 5
    assert m[("hidden_states_reader_pool_page_bytes", ())] == PAGE
    assert m[("hidden_states_reader_connections_refused_total", ())] == 3
    assert m[("hidden_states_reader_samples_refused_total", (("reason", "checksum"),))] == 0
    assert m[("hidden_states_reader_producers_connected", ())] == 2
    assert m[("hidden_states_reader_producer_ranks_connected", (("producer", "q"),))] == 1
    assert m[("hidden_states_reader_handout_latency_seconds_bucket", (("le", "0.01"),))] == 0
    assert m[("hidden_states_reader_handout_latency_seconds_bucket", (("le", "0.025"),))] == 1
    assert m[("hidden_states_reader_handout_latency_seconds_count", ())] == 1
    assert m[("hidden_states_reader_files_written_total", ())] == 1
    assert m[("hidden_states_reader_file_bytes_total", ())] == 1234
    assert m[("hidden_states_reader_fsync_seconds_count", ())] == 1
