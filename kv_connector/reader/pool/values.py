"""Sanity of a sample's hidden states: non-finite values, all-zero tokens and all-zero layers.

Each fault is named by token and layer. An all-zero token is the silent failure of a cache
row the forward pass never wrote; real hidden states are never zero in every captured layer
at once. A token is reported when all its captured layers are zero. One zero layer of one
token is not an error (an embedding row of zeros). A layer zero at every token of a sample
of two or more tokens is: the extraction never wrote it.

Pure: torch only. The check reads the sample where it lies, in one pass summing each token's
row in each layer; hidden is the contiguous dimension in either layout, so it runs at memory
speed. Float16 and float8 are widened a bounded chunk of tokens at a time. NaN and Inf
propagate into their row's sum, and an all-zero token has only zero sums. Only tokens whose
sums say so are then looked at exactly, to name their layers. A fault-free sample waits for
its device once.

Where the fingerprint's check reads a host pool anyway, the sampled screen runs on what it
brought: the 64-byte line around each sampled word (``screen_rows``, ``screened_clean``).
A pool on a GPU screens a share's whole rows in the pass and the wait its check has anyway
(``screen_flags``): a GPU sums them in microseconds, where a wait of its own at hand-out
costs a hand-back of the GIL. Only where a screen shows something does the hand-out look
closer (``find_bad_values``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kv_connector.common.errors import ConfigurationError, IntegrityError

# elements reduced at once (bounds the temporaries)
CHUNK_ELEMENTS = 1 << 22
# a sampled screen reads this many elements at the start and the middle of each row
SAMPLE_ELEMENTS = 32
# tokens named in a report
MAX_NAMED = 5
# dtypes summed in their own precision
_OWN_SUMS = (torch.float32, torch.float64, torch.bfloat16)


@dataclass(frozen=True)
class RowsScreen:
    """The sampled values screen of a share's rows (``screen_rows``).

    ``suspect``: a token's sampled values are non-finite or zero in every layer. ``alive``: for
    each captured layer, whether a sampled value of it was non-zero.
    """

    suspect: bool
    alive: tuple[bool, ...]

    @classmethod
    def of(cls, flags: torch.Tensor) -> RowsScreen:
        """The screen ``screen_flags`` queued, read (a wait for its device)."""
        got = flags.tolist()
        return cls(bool(got[0]), tuple(bool(a) for a in got[1:]))


class BadValues(IntegrityError):
    """A sample's hidden states hold NaN/Inf or an all-zero token; the message names them."""


def find_bad_values(
    hidden_states: torch.Tensor, layer_ids: Sequence[int], sample: bool = False
) -> str | None:
    """None when ``hidden_states`` [T, L, H] are sane, else what is wrong, by token and layer id.

    Sane means all finite, no token zero in every layer, and no layer zero at every token
    (T >= 2). With ``sample``, the screen reads ``SAMPLE_ELEMENTS`` at the start and middle of
    every row, and the whole sample only where they show something. It finds a row of garbage or
    an all-zero token or layer as a full check does, but not a lone NaN it does not read.
    """
    h = hidden_states.shape[-1] if hidden_states.dim() == 3 else 0
    if sample and samples(h):
        mid = h // 2
        picked = torch.cat(
            [hidden_states[:, :, :SAMPLE_ELEMENTS], hidden_states[:, :, mid : mid + SAMPLE_ELEMENTS]], dim=2
        )
        if _find(picked, layer_ids) is None:
            return None
    return _find(hidden_states, layer_ids)


def samples(hidden: int) -> bool:
    """Whether a sampled screen samples rows of ``hidden`` values (else it reads them whole)."""
    return hidden > 4 * SAMPLE_ELEMENTS


def screen_rows(rows: torch.Tensor) -> RowsScreen:
    """The sampled screen over ``rows`` ``[n, layers, k]``: ``k`` values of each token's row in each layer.

    The rows are those the fingerprint's check read (``fingerprint.states_record_lines``), and
    the screen waits for the device once.
    """
    if rows.shape[0] == 0:
        return RowsScreen(False, (False,) * rows.shape[1])
    # [n, L]
    sums = _row_sums(rows)
    return RowsScreen.of(torch.cat([_suspects(sums).any().view(1), (sums != 0).any(dim=0)]))


def screen_flags(states: torch.Tensor, spans: Iterable[tuple[int, int]]) -> torch.Tensor:
    """The screen of the whole rows of the tokens in ``spans`` (``[start, end)`` of ``states``
    ``[T, L, H]``), queued where the states lie and not waited for: ``[1 + L]`` bools, whether
    a token is suspect, then whether each layer holds a non-zero sum. ``RowsScreen.of`` reads
    them. Every value is read, a bounded chunk of tokens at a time."""
    n_layers = states.shape[1]
    step = _chunk_tokens(states)
    alive = torch.zeros(n_layers, dtype=torch.bool, device=states.device)
    seen = torch.zeros((), dtype=torch.bool, device=states.device)
    for start, end in spans:
        for t0 in range(start, end, step):
            sums = _row_sums(states[t0 : min(t0 + step, end)])
            alive |= (sums != 0).any(dim=0)
            seen |= _suspects(sums).any()
    return torch.cat([seen.view(1), alive])


def _row_sums(rows: torch.Tensor) -> torch.Tensor:
    """Each token's sum in each layer ``[t, L]`` of ``rows`` ``[t, L, k]``: float16 and float8
    widened to float32 (their sums overflow early), the others in their own dtype."""
    return rows.sum(dim=2) if rows.dtype in _OWN_SUMS else rows.to(torch.float32).sum(dim=2)


def _suspects(sums: torch.Tensor) -> torch.Tensor:
    """The tokens ``[t]`` whose row sums ``[t, L]`` hold NaN/Inf or are zero in every layer."""
    return ~torch.isfinite(sums).all(dim=1) | (sums == 0).all(dim=1)


def _chunk_tokens(states: torch.Tensor) -> int:
    """Tokens of ``states`` ``[T, L, H]`` summed at once: all where the sum needs no widened
    copy, else a bounded chunk."""
    if states.dtype in _OWN_SUMS:
        return max(1, states.shape[0])
    return max(1, CHUNK_ELEMENTS // max(1, states.shape[1] * states.shape[2]))


def screened_clean(parts: Iterable[RowsScreen], num_tokens: int, num_layers: int) -> bool:
    """True when a sample's share screens say what a sampled screen of the whole sample would.

    That is no suspect token and, for two tokens or more, no captured layer without a non-zero
    value. False asks ``find_bad_values`` to look closer.
    """
    suspect, alive, seen = False, [False] * num_layers, False
    for p in parts:
        seen = True
        suspect = suspect or p.suspect or len(p.alive) != num_layers
        alive = [a or b for a, b in zip(alive, p.alive, strict=False)]
    return seen and not suspect and (num_tokens < 2 or all(alive))


def _find(hidden_states: torch.Tensor, layer_ids: Sequence[int]) -> str | None:
    if hidden_states.dim() != 3 or hidden_states.shape[1] != len(layer_ids):
        raise ConfigurationError(f"hidden_states {tuple(hidden_states.shape)} for {len(layer_ids)} layer ids")
    t_total, n_layers, hidden = hidden_states.shape
    if t_total == 0 or hidden == 0:
        return None
    # float16 and float8 sums overflow early: sum those in float32 (a chunk at a time: the
    # widened copy is the only temporary; a sum in the states' own dtype needs none)
    wide = None if hidden_states.dtype in _OWN_SUMS else torch.float32
    step = _chunk_tokens(hidden_states)
    # (token, layer ids)
    non_finite: list[tuple[int, list[int]]] = []
    zero: list[int] = []
    device = hidden_states.device
    # a non-zero sum seen
    alive = torch.zeros(n_layers, dtype=torch.bool, device=device)
    # a suspect token seen
    seen = torch.zeros((), dtype=torch.bool, device=device)
    suspects: list[torch.Tensor] = []
    for t0 in range(0, t_total, step):
        chunk = hidden_states[t0 : t0 + step]
        # [t, L]
        sums = _row_sums(chunk)
        alive |= (sums != 0).any(dim=0)
        suspects.append(_suspects(sums))
        seen |= suspects[-1].any()
    # one wait for the device (or none on the host) for a sample without a fault: on a GPU
    # each wait is also a hand-back of the GIL, which a busy thread beside may hold for long
    any_suspect, any_dead = torch.stack([seen, ~alive.all()]).tolist()
    n_non_finite = n_zero = 0
    for t0, suspect in zip(range(0, t_total, step), suspects, strict=True) if any_suspect else ():
        chunk = hidden_states[t0 : t0 + step]
        for t in torch.nonzero(suspect).flatten().tolist():
            # [L, H]
            row = chunk[t] if wide is None else chunk[t].to(wide)
            finite = torch.isfinite(row).all(dim=1)
            if not bool(finite.all()):
                n_non_finite += 1
                if len(non_finite) < MAX_NAMED:
                    non_finite.append(
                        (t0 + t, [layer_ids[k] for k in torch.nonzero(~finite).flatten().tolist()])
                    )
            elif not bool(row.any()):
                n_zero += 1
                if len(zero) < MAX_NAMED:
                    zero.append(t0 + t)
    # captured layers zero at every token (checked exactly: a sum may cancel)
    dead: list[int] = []
    if t_total >= 2 and any_dead:
        dead = [k for k in torch.nonzero(~alive).flatten().tolist() if not bool(hidden_states[:, k].any())]
    if not n_non_finite and not n_zero and not dead:
        return None
    parts = []
    if n_non_finite:
        named = ", ".join(f"token {t} (layer ids {', '.join(map(str, ks))})" for t, ks in non_finite)
        more = f" and {n_non_finite - len(non_finite)} more" if n_non_finite > len(non_finite) else ""
        parts.append(f"NaN/Inf at {n_non_finite} of {t_total} tokens: {named}{more}")
    if n_zero:
        more = f" and {n_zero - len(zero)} more" if n_zero > len(zero) else ""
        parts.append(
            f"{n_zero} of {t_total} tokens all zero in every layer: token {', '.join(map(str, zero))}{more}"
        )
    if dead:
        names = ", ".join(str(layer_ids[k]) for k in dead)
        parts.append(f"captured layer ids {names} all zero at every one of the {t_total} tokens")
    return "; ".join(parts)


def check_values(hidden_states: torch.Tensor, layer_ids: Sequence[int]) -> None:
    """Raise ``BadValues`` naming what ``find_bad_values`` found."""
    problem = find_bad_values(hidden_states, layer_ids)
    if problem is not None:
        raise BadValues(problem)
