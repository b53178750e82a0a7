"""Fingerprints (``wire.fingerprint``): the producer's words, taken where the cache is in
the step that wrote the slots (``producer.fingerprints``, ``CacheBlocks.token_words``),
give the record the reader recomputes from what landed, in both layouts and dtypes; and
each fault class of docs/reliability.md that a fingerprint must catch changes the record:
one token slot of one layer overwritten, a block's tail zeroed, a block swapped for
another, a captured layer zeroed over the whole sample. One bit flipped in a word no
fingerprint samples is not caught (the full checksums are for that)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from kv_connector.cache.blocks import CacheBlocks, Share
from kv_connector.producer.fingerprints import Fingerprints
from kv_connector.producer.planning import BlockRecorder, StepSlice
from kv_connector.wire import fingerprint
from kv_connector.wire.identity import NO_IDENTITY
from kv_connector.wire.layout import BlockLayout
from kv_connector.wire.protocol import Manifest

LAYOUTS = [BlockLayout("LTH", 16, 3, 32, "float32"), BlockLayout("TLH", 16, 4, 64, "bfloat16")]
IDS = ["LTH-f32", "TLH-bf16"]
NUM_BLOCKS = 24
TOKENS = 3 * 16 + 5  # three full blocks and a tail of five


def cache_of(layout: BlockLayout, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_BLOCKS, *layout.block_shape(), generator=g).to(getattr(torch, layout.dtype))


def states_of(cache: torch.Tensor, layout: BlockLayout, blocks: list[int], n: int) -> torch.Tensor:
    """The sample as the reader sees it: ``[T, layers, hidden]``, straight from the cache."""
    view = cache if layout.layout == "TLH" else cache.permute(0, 2, 1, 3)
    return torch.cat([view[b] for b in blocks])[:n].contiguous()


def share_of(blocks: CacheBlocks, rid: str, table: list[int], world: int = 1, rank: int = 0) -> Share:
    layer_ids = [1, 2, 3, 4][: blocks.layout.num_layers]
    return blocks.share_of(rid, list(range(TOKENS)), table, layer_ids, NO_IDENTITY, rank, world)


def written_in_steps(
    blocks: CacheBlocks, rid: str, table: list[int], chunk: int, told_last: bool = False
) -> Fingerprints:
    """The words taken as vLLM's steps write the sample: prefill chunks of ``chunk``; with
    ``told_last``, the step that writes the last position knows it ships (the worker side
    tells ``take`` the last position of each sample its plan ships)."""
    bs = blocks.layout.block_size
    fp, rec = Fingerprints(blocks, bs), BlockRecorder(bs)
    for start in range(0, TOKENS, chunk):
        n = min(chunk, TOKENS - start)
        sl = StepSlice(rid, start, n, tuple(table) if start == 0 else (), 0 if start == 0 else len(table))
        planned, errors = rec.slots_of([sl])
        assert not errors
        fp.take(planned, {rid: TOKENS - 1} if told_last and start + n == TOKENS else None)
    return fp


@pytest.mark.parametrize("told_last", [False, True], ids=["last-at-ship", "last-in-step"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
@pytest.mark.parametrize("chunk", [TOKENS, 7, 1], ids=["one-step", "chunks", "token-by-token"])
def test_the_words_taken_in_the_steps_give_the_record_the_reader_recomputes(
    layout: BlockLayout, chunk: int, told_last: bool
) -> None:
    cache = cache_of(layout)
    blocks = CacheBlocks(cache, layout)
    table = [9, 2, 17, 4]
    taken = written_in_steps(blocks, "req-1", table, chunk, told_last)
    so_far = taken.taken("req-1")
    assert so_far is not None
    gathers = len(so_far.chunks)
    words = taken.ship("req-1", TOKENS, table)
    assert len(words.chunks) == gathers + (not told_last)  # the last token again only when not told
    states = states_of(cache, layout, table, TOKENS)
    for world in (1, 2, 3):
        for rank in range(world):
            s = share_of(blocks, "req-1", table, world, rank)
            assert words.record(s.manifest, s.share) == fingerprint.states_record(states, s.manifest, s.share)
    s = share_of(blocks, "req-1", table)
    other = share_of(blocks, "req-2", table)  # another request id: another seed and manifest
    assert words.record(s.manifest, s.share) != fingerprint.states_record(states, other.manifest, other.share)


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_positions_no_step_wrote_are_taken_at_ship_from_the_shipped_blocks(layout: BlockLayout) -> None:
    """A prefix-cache hit: the first two blocks were computed by an earlier request."""
    cache = cache_of(layout)
    blocks = CacheBlocks(cache, layout)
    table = [9, 2, 17, 4]
    bs = layout.block_size
    fp, rec = Fingerprints(blocks, bs), BlockRecorder(bs)
    planned, _ = rec.slots_of([StepSlice("r", 2 * bs, TOKENS - 2 * bs, tuple(table))])
    fp.take(planned)
    words = fp.ship("r", TOKENS, table)
    s = share_of(blocks, "r", table)
    assert words.record(s.manifest, s.share) == fingerprint.states_record(
        states_of(cache, layout, table, TOKENS), s.manifest, s.share
    )
    assert len(fp) == 0  # forgotten at its ship


def faults(layout: BlockLayout) -> dict[str, object]:
    """Each fault the default must catch, applied to the cache after the words were taken."""
    bs = layout.block_size
    view = lambda c: c if layout.layout == "TLH" else c.permute(0, 2, 1, 3)  # noqa: E731

    def slot_overwritten(c: torch.Tensor, table: list[int], t: int, layer: int) -> None:
        view(c)[table[t // bs], t % bs, layer] = view(c)[20, 3, layer]  # another sample's row

    def tail_zeroed(c: torch.Tensor, table: list[int]) -> None:
        view(c)[table[1], bs - 4 :] = 0

    def block_swapped(c: torch.Tensor, table: list[int]) -> None:
        c[table[2]] = c[21]

    def layer_zeroed(c: torch.Tensor, table: list[int]) -> None:
        for b in table:
            view(c)[b, :, 1] = 0

    return {
        "slot_overwritten": slot_overwritten,
        "tail_zeroed": tail_zeroed,
        "block_swapped": block_swapped,
        "layer_zeroed": layer_zeroed,
    }


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_every_fault_class_changes_the_record(layout: BlockLayout) -> None:
    table = [9, 2, 17, 4]
    for name, fault in faults(layout).items():
        cases = [(t, layer) for t in (0, 15, 16, 31, TOKENS - 1) for layer in range(layout.num_layers)]
        for args in cases if name == "slot_overwritten" else [()]:
            cache = cache_of(layout)
            blocks = CacheBlocks(cache, layout)
            words = written_in_steps(blocks, "req-1", table, 16).ship("req-1", TOKENS, table)
            fault(cache, table, *args)  # type: ignore[operator]
            s = share_of(blocks, "req-1", table)
            landed = fingerprint.states_record(states_of(cache, layout, table, TOKENS), s.manifest, s.share)
            assert words.record(s.manifest, s.share) != landed, (name, args)


def test_one_bit_flipped_in_a_word_no_fingerprint_samples_is_not_caught() -> None:
    """The documented limit: a change that spares every sampled word."""
    layout = LAYOUTS[0]
    cache = cache_of(layout)
    blocks = CacheBlocks(cache, layout)
    table = [9, 2, 17, 4]
    words = written_in_steps(blocks, "req-1", table, TOKENS).ship("req-1", TOKENS, table)
    s = share_of(blocks, "req-1", table)
    n_words = layout.row_bytes // 8
    seed = fingerprint.seed_of("req-1")
    bs = layout.block_size
    word = fingerprint.coordinates(seed, np.array([5]), layout.num_layers, n_words, bs, TOKENS - 1)
    spared = next(w for w in range(n_words) if w != word[0, 0])
    row = cache.permute(0, 2, 1, 3)[table[0], 5, 0].view(torch.int32)  # token 5, layer 0
    row[2 * spared] ^= 1 << 7  # one bit of a word no fingerprint samples
    landed = fingerprint.states_record(states_of(cache, layout, table, TOKENS), s.manifest, s.share)
    assert words.record(s.manifest, s.share) == landed


def test_the_words_are_a_small_part_of_the_bytes_and_cover_every_block_edge() -> None:
    layout = BlockLayout("TLH", 16, 4, 4096, "bfloat16")
    assert layout.num_layers * 8 / layout.token_bytes < 0.001  # 32 bytes of 32 KiB a token
    words, bs, n = layout.row_bytes // 8, layout.block_size, 3 * 16 + 5
    word = fingerprint.coordinates(7, np.arange(n), layout.num_layers, words, bs, n - 1)
    assert (word[::bs, 0] == 0).all()  # every block's first word
    assert (word[bs - 1 :: bs, -1] == words - 1).all() and word[n - 1, -1] == words - 1  # and its last
    assert len({tuple(word[t]) for t in range(n)}) > n // 2  # positions vary from token to token
    other = fingerprint.coordinates(8, np.arange(n), layout.num_layers, words, bs, n - 1)
    assert (other != word).any()  # and from sample to sample


def test_a_shares_tokens_and_spans_are_its_blocks_valid_positions_in_order() -> None:
    from kv_connector.wire.protocol import Manifest

    g = BlockLayout("TLH", 16, 2, 8, "float32")
    for total in (1, 15, 16, 17, 53, 64):
        nb = -(-total // 16)
        tokens = list(range(total))
        m = Manifest(request_id="r", token_ids=tokens, layer_ids=[1, 2], geometry=g, num_blocks=nb)
        for share in ([], list(range(nb)), list(range(0, nb, 2)), list(range(1, nb, 3)), [nb - 1]):
            want = [p for j in sorted(share) for p in range(j * 16, min((j + 1) * 16, total))]
            assert fingerprint.share_tokens(m, share).tolist() == want, (total, share)
            spans = fingerprint.share_spans(m, share)  # the same tokens, as maximal runs
            assert [p for a, b in spans for p in range(a, b)] == want, (total, share)
            assert all(a < b for a, b in spans), spans
            assert all(x[1] < y[0] for x, y in itertools.pairwise(spans)), spans


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_a_steps_ships_share_one_gather_and_a_sample_that_fails_fails_alone(layout: BlockLayout) -> None:
    """The worker side ships a step's samples together (``ship_many``): the words still due
    of all of them (each one's last token, a prefix-cache hit's blocks) in one gather, each
    sample's record still its own; one whose blocks cannot hold its tokens gets its error."""
    cache = cache_of(layout)
    blocks = CacheBlocks(cache, layout)
    bs = layout.block_size
    tables = {"a": [9, 2, 17, 4], "b": [1, 3, 5, 7], "c": [11, 12, 13, 14]}
    fp, rec = Fingerprints(blocks, bs), BlockRecorder(bs)
    slices = [
        StepSlice("a", 0, TOKENS, tuple(tables["a"])),
        StepSlice("b", 2 * bs, TOKENS - 2 * bs, tuple(tables["b"])),  # its first two blocks: a prefix hit
        StepSlice("c", 0, TOKENS, tuple(tables["c"])),
    ]
    planned, errors = rec.slots_of(slices)
    assert not errors
    fp.take(planned)
    got = fp.ship_many([(rid, TOKENS, table) for rid, table in tables.items()] + [("d", TOKENS, [6])])
    assert isinstance(got["d"], ValueError)  # one block cannot hold 53 tokens; the others ship
    shipped = [got[rid] for rid in tables]
    at_ship = {id(w.chunks[-1][0]) for w in shipped if not isinstance(w, Exception)}
    assert len(at_ship) == 1  # the words due at ship: one gather for the three
    for rid, table in tables.items():
        words = got[rid]
        assert not isinstance(words, Exception)
        s = share_of(blocks, rid, table)
        assert words.record(s.manifest, s.share) == fingerprint.states_record(
            states_of(cache, layout, table, TOKENS), s.manifest, s.share
        )
    assert len(fp) == 0  # every one forgotten, the failed one too


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_a_ship_gather_that_fails_is_retried_alone_and_its_failed_try_gives_no_words(
    layout: BlockLayout,
) -> None:
    """A step's ship gather that fails (one sample's table names a block the cache does not
    have) is tried again a sample at a time: the bad one gets its error, and each other's
    record is its own, from the second try's words (the failed try's samples were told
    their rows before the gather, which then gave none)."""
    cache = cache_of(layout)
    blocks = CacheBlocks(cache, layout)
    bs = layout.block_size
    tables = {"b": [1, 3, 5, 7], "e": [NUM_BLOCKS + 40, 8, 10, 15]}  # e's first block is not there
    fp, rec = Fingerprints(blocks, bs), BlockRecorder(bs)
    planned, errors = rec.slots_of(
        [StepSlice(rid, 2 * bs, TOKENS - 2 * bs, tuple(t)) for rid, t in tables.items()]  # prefix hits
    )
    assert not errors
    fp.take(planned)
    got = fp.ship_many([(rid, TOKENS, t) for rid, t in tables.items()])
    assert isinstance(got["e"], Exception)
    words = got["b"]
    assert not isinstance(words, Exception)
    assert any(taken.words is None for taken, *_ in words.chunks)  # the failed try's rows
    s = share_of(blocks, "b", tables["b"])
    assert words.record(s.manifest, s.share) == fingerprint.states_record(
        states_of(cache, layout, tables["b"], TOKENS), s.manifest, s.share
    )


@pytest.mark.parametrize("hidden", [16, 64, 100])  # bf16 rows of 4, 16 and 25 words
@pytest.mark.parametrize("layout", ["TLH", "LTH"])
def test_a_lines_gather_reads_the_aligned_line_around_each_sampled_word(layout: str, hidden: int) -> None:
    """``gather_lines`` gives ``gather``'s words, each inside the ``LINE`` words of its row
    that it reads with it: aligned to a line in the row, the row's last line at its end."""
    g = BlockLayout(layout, 16, 3, hidden, "bfloat16")  # type: ignore[arg-type]
    cache = cache_of(g)
    states = states_of(cache, g, [5, 2, 9, 0], TOKENS)
    if layout == "LTH":  # the same values as a strided view, as a pool's LTH sample is
        states = states.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    words = fingerprint.as_words(states)
    row = words.shape[-1]
    positions = np.arange(TOKENS, dtype=np.int64)
    if row < fingerprint.LINE:
        with pytest.raises(ValueError, match="shorter than a line"):
            fingerprint.gather_lines(words, positions, 7, 16, TOKENS - 1)
        return
    sampled, lines = fingerprint.gather_lines(words, positions, 7, 16, TOKENS - 1)
    assert torch.equal(sampled, fingerprint.gather(words, (positions,), positions, 7, 16, TOKENS - 1))
    at = fingerprint.coordinates(7, positions, g.num_layers, row, 16, TOKENS - 1)
    for t in range(TOKENS):
        for k in range(g.num_layers):
            start = min(at[t, k] - at[t, k] % fingerprint.LINE, row - fingerprint.LINE)
            assert torch.equal(lines[t, k], words[t, k, start : start + fingerprint.LINE])


def test_a_shares_record_from_lines_is_its_record_and_its_lines_are_its_states() -> None:
    g = LAYOUTS[1]
    states = states_of(cache_of(g), g, [5, 2, 9, 0], TOKENS)
    m = manifest_of(g, TOKENS)
    for share in ([0, 1, 2, 3], [1, 3], []):
        digest, lines = fingerprint.states_record_lines(states, m, share)
        assert digest == fingerprint.states_record(states, m, share)
        assert lines is not None and lines.dtype == states.dtype
        assert lines.shape == (len(fingerprint.share_tokens(m, share)), g.num_layers, 32)
    narrow = BlockLayout("TLH", 16, 3, 8, "bfloat16")  # rows of 2 words: no line
    small = states_of(cache_of(narrow), narrow, [5, 2, 9, 0], TOKENS)
    digest, lines = fingerprint.states_record_lines(small, manifest_of(narrow, TOKENS), [0, 1])
    assert lines is None and digest == fingerprint.states_record(small, manifest_of(narrow, TOKENS), [0, 1])


def manifest_of(g: BlockLayout, total: int) -> Manifest:
    layer_ids = list(range(1, g.num_layers + 1))
    return Manifest(
        request_id="r",
        token_ids=list(range(total)),
        layer_ids=layer_ids,
        geometry=g,
        num_blocks=-(-total // 16),
    )
