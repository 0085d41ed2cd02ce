"""A streamed reply's text decoded from its newest tokens equals decoding the whole reply
at every token: for the embedded model's tokenizer and for tokenizers built here with
each kind of decoder real models use (byte-level BPE; SentencePiece's byte fallback,
fused pieces and stripped first space; Metaspace; WordPiece's joined pieces), over
random replies with characters cut between tokens, bytes that never form a character
and special tokens, starting after text of their own as a continued reply does."""

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models
from tokenizers.pre_tokenizers import ByteLevel

from h2o_chat.sessions.pins import decode
from h2o_chat.sessions.reply_text import REPLACEMENT, ReplyText

SPECIALS = ["<s>", "</s>"]


def _with_specials(tokenizer: Tokenizer) -> Tokenizer:
    tokenizer.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    return tokenizer


def _sentencepiece(decoder) -> Tokenizer:
    """Llama 2's kind: pieces marked by ``▁`` for a space, and a byte token for each byte."""
    pieces = ["▁", "▁the", "▁cat", "a", "b", "é", "▁dé", "jà", "!", "▁\n", "ñ", "▁日本", "語"]
    vocab = {f"<0x{byte:02X}>": byte for byte in range(256)}
    vocab |= {piece: 256 + i for i, piece in enumerate(pieces)}
    return _with_specials(_set_decoder(Tokenizer(models.BPE(vocab, [], byte_fallback=True)), decoder))


def _set_decoder(tokenizer: Tokenizer, decoder) -> Tokenizer:
    tokenizer.decoder = decoder
    return tokenizer


def _byte_level() -> Tokenizer:
    """GPT-2's kind: every byte a printable character, pieces of them."""
    pieces = sorted(ByteLevel.alphabet()) + ["Ġthe", "Ġcat", "ĠdÃ©", "jÃł", "Ċ", "ĠæĹ¥", "æľ¬"]
    return _with_specials(_set_decoder(Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [])),
                                       decoders.ByteLevel()))


def _wordpiece() -> Tokenizer:
    pieces = ["[UNK]", "the", "cat", "##s", "##é", "dé", "##jà", "!", "日", "##本"]
    tokenizer = Tokenizer(models.WordPiece({p: i for i, p in enumerate(pieces)}, unk_token="[UNK]"))
    return _with_specials(_set_decoder(tokenizer, decoders.WordPiece()))


TOKENIZERS = {
    "byte-level BPE": _byte_level,
    "SentencePiece (byte fallback, fuse, strip)": lambda: _sentencepiece(decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])),
    "Metaspace": lambda: _sentencepiece(decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])),
    "WordPiece": _wordpiece,
}


# The texts replies are made of. A byte-fallback tokenizer spells characters outside its
# pieces in byte tokens, which decode as one run: a prefix cut inside a character of three
# bytes or more decodes to several replacement characters, and decoding everything shows
# one of them before the character comes (it strips only the last): its characters here
# are of one and two bytes.
CHARACTERS = {None: "a é ñ — 日本語 🐉 the cat déjà\n", "SentencePiece (byte fallback, fuse, strip)": "a é ñ ▁ 語 ! b ü ▁the",
              "Metaspace": "a é ñ ▁ 語 ! b ü ▁the"}


class _Decoding:
    """``decode`` as the sessions call it, over a ``tokenizers.Tokenizer``."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def _whole(decode, lead: list[int], adds: list[list[int]]) -> list[str]:
    """What streaming by decoding everything each time sends (the sessions' rule before),
    up to where decoding everything takes back text it sent (a run of byte tokens turned
    invalid): no stream can follow that."""
    tokens, sent, out = lead, decode(lead).removesuffix(REPLACEMENT), []
    for add in adds:
        tokens = tokens + add
        text = decode(tokens).removesuffix(REPLACEMENT)
        if not text.startswith(sent):
            break
        out.append(text[len(sent) :])
        sent = text
    return out


def _replies(tokenizer: Tokenizer, count: int, seed: int, characters: str = "a é ñ — 日本語 🐉 the cat déjà\n"
             ) -> list[tuple[list[int], list[list[int]]]]:
    """Random replies: tokens of text with characters of one to four bytes (a byte
    tokenizer's byte tokens cut them anywhere); in one reply of four, any token at all
    one time in ten."""
    rng = random.Random(seed)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    replies = []
    for index in range(count):
        ids, stray = [], 0.1 if index % 4 == 0 else 0.0
        while len(ids) < 80:
            ids += ([rng.randrange(vocab)] if rng.random() < stray else
                    tokenizer.encode(rng.choice(characters.split(" ")), add_special_tokens=False).ids)
        lead = ids[: rng.choice([0, 0, 1, 3])]
        rest, adds = ids[len(lead) :], []
        while rest:
            take = rng.choice([1, 1, 1, 1, 2, 3])
            adds.append(rest[:take])
            rest = rest[take:]
        replies.append((lead, adds))
    return replies


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_streamed_text_equals_decoding_everything_for_every_decoder(kind):
    tokenizer = TOKENIZERS[kind]()
    decode_ids = _Decoding(tokenizer)
    compared = steps = 0
    for lead, adds in _replies(tokenizer, 200, len(kind), CHARACTERS.get(kind, CHARACTERS[None])):
        text = ReplyText(decode_ids, lead)
        got = [text.grow(add) for add in adds]
        want = _whole(decode_ids, lead, adds)
        assert got[: len(want)] == want, (lead, adds)
        compared, steps = compared + len(want), steps + len(adds)
    assert compared > 0.5 * steps  # most replies never take text back


def test_streamed_text_of_the_embedded_tokenizer_equals_decoding_everything(smollm):
    """The model's own text, cut into single tokens and pairs, a CJK and emoji passage whose
    characters span tokens, and random ids of its whole vocabulary (special tokens too)."""
    _, tokenizer = smollm
    passages = ["Once upon a time, a dragon named Zorath lived in a cave.\n\nThe end.",
                "déjà vu — 日本語のテキスト 🐉🔥 emoji, ñ and ü; <|im_end|> as text"]
    for passage in passages:
        ids = tokenizer(passage, add_special_tokens=False).input_ids
        for lead_length in (0, 1, 3):
            lead, rest = ids[:lead_length], ids[lead_length:]
            adds = [rest[i : i + 1] for i in range(len(rest))]
            text = ReplyText(lambda t: decode(tokenizer, t), lead)
            got = [text.grow(add) for add in adds]
            assert got == _whole(lambda t: decode(tokenizer, t), lead, adds)
            assert decode(tokenizer, lead) + "".join(got) == passage
    for lead, adds in _replies(tokenizer.backend_tokenizer, 50, seed=11):
        text = ReplyText(lambda t: decode(tokenizer, t), lead)
        want = _whole(lambda t: decode(tokenizer, t), lead, adds)
        assert [text.grow(add) for add in adds] == want  # byte-level: never takes text back
