"""Drawing the next tokens of every row of a pass at once: greedy or nucleus sampling.

What a row's draw needs from the device is small: its most likely token, or the few
hundred most likely tokens with their probabilities, among which a nucleus nearly always
lies. So the device ranks every row at once and draws there, every row at once, seeded
or not: a seeded row's noise is a hash of its key and each token's id, so it draws the
same token beside any others or alone, and no row loops on the host; where no row is
seeded, the noise is drawn fresh (two operations a step where the hash takes thirty).
The host reads every row's token in one transfer. The rows whose nucleus reaches past
those candidates (a very flat distribution, or ``top_p`` 1) draw again from their whole
distributions, on the device too, all at once: two reads a step at most.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

import torch

from .config import ConfigError, GenerationConfig, check_field
from .inputs import InputError

# The most likely tokens looked at first for a nucleus.
NUCLEUS_CANDIDATES = 256
# A row's settings as the device takes them: one float64 row each, uploaded at once.
_TEMPERATURE, _LIMIT, _KEY = 0, 1, slice(2, 4)


@dataclass
class Sampling:
    max_new_tokens: int = GenerationConfig.max_new_tokens
    temperature: float = GenerationConfig.temperature  # 0 = greedy
    top_p: float = GenerationConfig.top_p
    seed: int | None = None
    # The end-of-turn token is not sampled before this many tokens (benchmarks ask for
    # replies of an exact length; max_new_tokens makes the end never come).
    min_new_tokens: int = 0

    def __post_init__(self) -> None:
        # The same rules as the config file's generation section, so messages match; a
        # caller's values are input from outside, refused as such.
        for name in ("max_new_tokens", "temperature", "top_p", "seed"):
            try:
                setattr(self, name, check_field(f"generation.{name}", getattr(self, name)))
            except ConfigError as err:
                raise InputError(str(err), name) from None
        if not (isinstance(self.min_new_tokens, int) and 0 <= self.min_new_tokens <= self.max_new_tokens):
            raise InputError(f"min_new_tokens = {self.min_new_tokens!r}: must be an integer from 0 "
                             f"to max_new_tokens ({self.max_new_tokens})", "min_new_tokens")


@dataclass
class Draw:
    """One row's next token to draw: per ``sampling``, the ``index``-th of its reply
    (where seeded, the seed and the index fix the noise it draws with), never one of
    ``banned`` (token ids; None: any)."""

    sampling: Sampling
    index: int = 0
    banned: torch.Tensor | None = None


def draw_tokens(logits: torch.Tensor, rows: list[int], draws: list[Draw]) -> list[int]:
    """The token ``draws[i]`` draws from row ``rows[i]`` of ``logits`` ``(batch, vocab)``.
    The banned tokens are written into ``logits``."""
    _ban(logits, rows, draws)
    greedy = [i for i, draw in enumerate(draws) if draw.sampling.temperature == 0]
    sampled = [i for i, draw in enumerate(draws) if draw.sampling.temperature > 0]
    parts = []
    if greedy:
        parts.append(logits[_index([rows[i] for i in greedy], logits)].argmax(dim=-1).to(torch.float64))
    if sampled:
        # Keys only where some row is seeded: else fresh noise, without the hash.
        keyed = any(draws[i].sampling.seed is not None for i in sampled)
        settings = _settings([draws[i] for i in sampled], keyed).to(logits.device)
        scaled = logits[_index([rows[i] for i in sampled], logits)].float()
        temperatures = settings[:, _TEMPERATURE, None].float()
        probs = torch.softmax((scaled - scaled.amax(dim=-1, keepdim=True)) / temperatures, dim=-1)
        vocab = probs.shape[-1]
        top, ids = probs.topk(min(NUCLEUS_CANDIDATES, vocab))
        limits = settings[:, _LIMIT, None].float()
        keys = settings[:, _KEY].long() if keyed else None
        before = top.cumsum(-1) - top  # the mass of the more likely candidates
        # Where the candidates' last is outside the nucleus, the nucleus lies among them.
        within = (before[:, -1] >= limits[:, 0]) | (top.shape[-1] == vocab)
        parts += [_race(top, ids, before, limits, keys).to(torch.float64), within.to(torch.float64)]
    # One read of the device for every row (float64 holds token ids exactly).
    host = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu()
    tokens = [0] * len(draws)
    for i, token in zip(greedy, host[: len(greedy)].long().tolist()):
        tokens[i] = token
    if not sampled:
        return tokens
    chosen, inside = host[len(greedy) :].view(2, -1).long().tolist()
    beyond = [j for j, within_row in enumerate(inside) if not within_row]  # indices into ``sampled``
    for j, token in enumerate(chosen):
        tokens[sampled[j]] = token
    if beyond:  # a second read, of every such row at once
        for j, token in zip(beyond, _draw_beyond(probs, limits, keys, beyond, [draws[sampled[j]] for j in beyond])):
            tokens[sampled[j]] = token
    return tokens


def _settings(draws: list[Draw], keyed: bool) -> torch.Tensor:
    """Sampled rows' temperature, nucleus limit and noise key, ``(rows, 4)`` float64 on the
    host. A tiny temperature (5e-324 is a valid one) would overflow the logits over it to
    infinity and the softmax to NaN: it is kept from underflowing float32 to 0 (the logits
    are taken below their maximum first), so it tends to the greedy token, as it should.
    ``top_p`` 1 keeps every token: no limit, whatever the float sums come to. ``keyed``:
    unseeded rows' keys are drawn fresh; else every key is 0 and unused."""
    tiny = torch.finfo(torch.float32).tiny
    unseeded = sum(draw.sampling.seed is None for draw in draws) if keyed else 0
    fresh = iter(torch.randint(0, 2**32, (unseeded, 2)).tolist() if unseeded else [])
    return torch.tensor([
        [max(draw.sampling.temperature, tiny), draw.sampling.top_p if draw.sampling.top_p < 1 else math.inf,
         *(_seeded_key(draw.sampling.seed, draw.index) if draw.sampling.seed is not None
           else next(fresh) if keyed else (0, 0))]
        for draw in draws], dtype=torch.float64)


def _seeded_key(seed: int, index: int) -> tuple[int, int]:
    """A seeded row's noise key for the ``index``-th token of its reply: two 32-bit words."""
    digest = hashlib.blake2b(struct.pack("<QQ", seed, index), digest_size=8, person=b"h2o-chat-draw").digest()
    return struct.unpack("<II", digest)


def _race(top: torch.Tensor, ids: torch.Tensor, before: torch.Tensor, limits: torch.Tensor,
          keys: torch.Tensor | None) -> torch.Tensor:
    """Each row's token among tokens ``ids`` of probabilities ``top`` (descending where a
    row's ``limits`` is finite; ``before``: the mass of the more likely ones): of the
    nucleus, the one maximising probability / Exp(1) noise, which draws each in
    proportion to its probability, whichever tokens of the vocabulary are looked at."""
    race = torch.where(before < limits, top.double() / _exponential(ids, keys), -1.0)
    return ids.gather(-1, race.argmax(dim=-1, keepdim=True))[:, 0]


def _exponential(ids: torch.Tensor, keys: torch.Tensor | None) -> torch.Tensor:
    """Exp(1) noise for token ids ``ids`` ``(rows, n)``: from each row's key ``(rows, 2)``,
    a function of the key and the id alone (a 32-bit integer hash, twice); without keys,
    drawn fresh. Never 0, so no probability of 0 (a banned token) races as NaN; a uniform
    draw of 0 gives infinite noise, which no token wins with."""
    if keys is None:
        return torch.rand(ids.shape, dtype=torch.float64, device=ids.device).log_().neg_()
    bits = _mix(_mix(ids ^ keys[:, :1]) ^ keys[:, 1:])
    return -torch.log(((bits >> 8).double() + 0.5) * 2.0**-24)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash, in int64 (its multipliers are under 2**31, so no product overflows)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)


def _draw_beyond(probs: torch.Tensor, limits: torch.Tensor, keys: torch.Tensor | None, beyond: list[int],
                 draws: list[Draw]) -> list[int]:
    """The tokens of rows ``beyond`` of ``probs``, whose nucleus reaches past the candidates,
    drawn from their whole distributions: with the same noise where keyed, else with fresh
    noise, as fair (whether a row draws again depends on its distribution alone)."""
    which = torch.tensor(beyond, device=probs.device)
    probs, limits = probs[which], limits[which]
    keys = None if keys is None else keys[which]
    if all(draw.sampling.top_p >= 1 for draw in draws):  # no nucleus to find: no sort
        ids = torch.arange(probs.shape[-1], device=probs.device).expand_as(probs)
        return _race(probs, ids, torch.zeros_like(probs), limits, keys).tolist()
    ranked, ids = probs.sort(dim=-1, descending=True)
    return _race(ranked, ids, ranked.cumsum(-1) - ranked, limits, keys).tolist()


def _index(rows: list[int], logits: torch.Tensor) -> slice | torch.Tensor:
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, device=logits.device)


def _ban(logits: torch.Tensor, rows: list[int], draws: list[Draw]) -> None:
    """Every row's banned tokens to -inf, in one write."""
    bans = [(row, draw.banned) for row, draw in zip(rows, draws) if draw.banned is not None and draw.banned.numel()]
    if bans:
        # A few operations whatever the rows: every row of a story bans its end of turn.
        counts = torch.tensor([banned.numel() for _, banned in bans])
        which = torch.tensor([row for row, _ in bans]).repeat_interleave(counts).to(logits.device)
        tokens = torch.cat([banned for _, banned in bans]).to(logits.device)
        logits.index_put_((which, tokens), torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
