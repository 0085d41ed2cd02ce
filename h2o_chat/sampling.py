"""Drawing the next tokens of every row of a pass at once: greedy or nucleus sampling.

What a row's draw needs from the device is small: its most likely token, or the few
hundred most likely tokens with their probabilities, among which a nucleus nearly always
lies. So the device ranks every row at once; unseeded rows draw there too, every row at
once, and the host reads their tokens with the ranking of the seeded rows in one
transfer; each seeded row then draws with its own generator on the host, so a seeded
row's tokens do not depend on the rows beside it. The rows whose nucleus reaches past
those candidates (a very flat distribution, or ``top_p`` 1) read their whole
distributions in a second transfer, all at once: two reads a step at most.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .config import ConfigError, GenerationConfig, check_field
from .inputs import InputError

# The most likely tokens looked at first for a nucleus.
NUCLEUS_CANDIDATES = 256


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
    """One row's next token to draw: per ``sampling``, with ``generator`` where seeded,
    never one of ``banned`` (token ids; None: any)."""

    sampling: Sampling
    generator: torch.Generator | None = None
    banned: torch.Tensor | None = None


def draw_tokens(logits: torch.Tensor, rows: list[int], draws: list[Draw]) -> list[int]:
    """The token ``draws[i]`` draws from row ``rows[i]`` of ``logits`` ``(batch, vocab)``.
    The banned tokens are written into ``logits``."""
    _ban(logits, rows, draws)
    greedy = [i for i, draw in enumerate(draws) if draw.sampling.temperature == 0]
    sampled = [i for i, draw in enumerate(draws) if draw.sampling.temperature > 0]
    # Of the sampled rows (as indices into ``sampled``): drawn on the device, every row at
    # once, or on the host with the row's own generator.
    unseeded = [j for j, i in enumerate(sampled) if draws[i].generator is None]
    seeded = [j for j, i in enumerate(sampled) if draws[i].generator is not None]
    parts, probs = [], None
    if greedy:
        parts.append(logits[_index([rows[i] for i in greedy], logits)].argmax(dim=-1).to(torch.float64))
    if sampled:
        # A tiny temperature (5e-324 is a valid one) would overflow the logits over it to
        # infinity and the softmax to NaN: the logits are taken below their maximum first,
        # and the temperature is kept from underflowing float32 to 0, so it tends to the
        # greedy token, as it should.
        tiny = torch.finfo(torch.float32).tiny
        temperatures = torch.tensor([[max(draws[i].sampling.temperature, tiny)] for i in sampled], device=logits.device)
        scaled = logits[_index([rows[i] for i in sampled], logits)].float()
        probs = torch.softmax((scaled - scaled.amax(dim=-1, keepdim=True)) / temperatures, dim=-1)
        top, ids = probs.topk(min(NUCLEUS_CANDIDATES, probs.shape[-1]))
        if unseeded:
            parts += _draw_unseeded(_some(top, unseeded), _some(ids, unseeded),
                                    [draws[sampled[j]].sampling.top_p for j in unseeded], probs.shape[-1])
        if seeded:
            parts += [_some(top, seeded).flatten().to(torch.float64), _some(ids, seeded).flatten().to(torch.float64)]
    # One read of the device for every row (float64 holds token ids exactly).
    host = torch.cat(parts).cpu() if len(parts) > 1 else parts[0].cpu()
    tokens = [0] * len(draws)
    for i, token in zip(greedy, host[: len(greedy)].long().tolist()):
        tokens[i] = token
    if not sampled:
        return tokens
    vocab = probs.shape[-1]
    beyond = []  # indices into ``sampled`` of rows whose nucleus reaches past the candidates
    if unseeded:
        chosen, within = host[len(greedy) : len(greedy) + 2 * len(unseeded)].view(2, -1).long().tolist()
        for j, token, inside in zip(unseeded, chosen, within):
            if inside:
                tokens[sampled[j]] = token
            else:
                beyond.append(j)
    if seeded:
        top, ids = host[len(greedy) + 2 * len(unseeded) :].view(2, len(seeded), -1)
        top = top.float()
        # The mass of the more likely candidates, every row at once (as ``nucleus`` sums it).
        before = (top.cumsum(-1) - top).numpy()
        top, ids = top.numpy(), ids.long().numpy()
        for k, j in enumerate(seeded):
            draw = draws[sampled[j]]
            if _within(before[k], draw.sampling.top_p, vocab):
                tokens[sampled[j]] = _draw(top[k], ids[k], before[k], draw.sampling.top_p, vocab, draw.generator)
            else:
                beyond.append(j)
    if beyond:  # a second read, of every such row at once
        whole = probs[torch.tensor(beyond, device=probs.device)].cpu()
        for row, j in zip(whole, beyond):
            tokens[sampled[j]] = _draw_from(row, draws[sampled[j]])
    return tokens


def _some(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``rows`` of ``t``, without a copy where they are all of them."""
    return t if len(rows) == t.shape[0] else t[torch.tensor(rows, device=t.device)]


def _draw_unseeded(top: torch.Tensor, ids: torch.Tensor, top_p: list[float], vocab: int) -> list[torch.Tensor]:
    """Unseeded rows' tokens drawn where their most likely tokens ``top``/``ids`` lie, every
    row at once: the token of the nucleus maximising probability / Exp(1) noise (noise for
    the nucleus alone: the same distribution as for the whole vocabulary). With each
    row's token, whether its nucleus lies among the candidates (else it is drawn again
    from the whole distribution). As float64, for the step's one read."""
    before = top.cumsum(-1) - top  # the mass of the more likely candidates
    limit = torch.tensor(top_p, device=top.device)[:, None]
    within = (limit[:, 0] < 1) & ((before[:, -1] >= limit[:, 0]) | (top.shape[-1] == vocab))
    race = torch.where(before < limit, top / torch.empty_like(top).exponential_(1), -1.0)
    chosen = ids.gather(-1, race.argmax(dim=-1, keepdim=True))[:, 0]
    return [chosen.to(torch.float64), within.to(torch.float64)]


def _within(before: np.ndarray, top_p: float, vocab: int) -> bool:
    """Whether a row's nucleus lies among its candidates (their preceding masses ``before``)."""
    return top_p < 1 and (before[-1] >= top_p or len(before) == vocab)


def _index(rows: list[int], logits: torch.Tensor) -> slice | torch.Tensor:
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, device=logits.device)


def _ban(logits: torch.Tensor, rows: list[int], draws: list[Draw]) -> None:
    """Every row's banned tokens to -inf, in one write."""
    bans = [(row, draw.banned) for row, draw in zip(rows, draws) if draw.banned is not None and draw.banned.numel()]
    if bans:
        which = torch.cat([torch.full_like(banned, row) for row, banned in bans]).to(logits.device)
        tokens = torch.cat([banned for _, banned in bans]).to(logits.device)
        logits.index_put_((which, tokens), torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))


def _draw(top: np.ndarray, ids: np.ndarray, before: np.ndarray, top_p: float, vocab: int,
          generator: torch.Generator) -> int:
    """A seeded row's token from its nucleus among its most likely tokens ``top``/``ids``
    (descending; ``before``: the mass of the more likely ones). Drawn as
    ``torch.multinomial`` draws from the whole distribution with the nucleus kept (the
    token maximising probability / Exp(1) noise, one noise value per token of the
    vocabulary), so a seed gives the tokens ``_draw_from`` would."""
    kept = before < top_p
    noise = torch.empty(vocab).exponential_(1, generator=generator).numpy()
    candidates = ids[kept]
    return int(candidates[np.argmax(top[kept] / noise[candidates])])


def _draw_from(probs: torch.Tensor, draw: Draw) -> int:
    """A sampled row's token from its whole distribution ``probs`` (host memory)."""
    if draw.sampling.top_p < 1:
        probs = nucleus(probs, draw.sampling.top_p)
    return torch.multinomial(probs, 1, generator=draw.generator).tolist()[0]


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` ``(vocab,)`` with every token zeroed but the smallest set of the most likely
    whose mass reaches ``top_p`` (always at least one). Sorting the whole vocabulary took
    3.5 ms a sampled token on the development machine: at 32 rows, over half as long as
    the decode step's model pass (6 ms a row); the nucleus nearly always lies among the
    few hundred most likely tokens, so those are ranked first (0.2 ms) and the whole
    vocabulary only where they do not reach ``top_p``."""
    ranked, order = probs.topk(min(NUCLEUS_CANDIDATES, probs.shape[-1]))
    before = ranked.cumsum(-1) - ranked  # the mass of the more likely tokens
    if before[-1].tolist() < top_p and len(ranked) < probs.shape[-1]:  # the nucleus may go on past them
        ranked, order = probs.sort(descending=True)
        before = ranked.cumsum(-1) - ranked
    kept = order[before < top_p]
    chosen = torch.zeros_like(probs)
    chosen[kept] = probs[kept]
    return chosen
