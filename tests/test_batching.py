"""Batched decoding: conversations decoding together give what each gives alone."""

import gc
import threading
import weakref

import pytest
import torch

from h2o_chat import ChatSession, StorySession, make_cache
from h2o_chat.engine.step import DecodeStep
from h2o_chat.generation import Generation
from h2o_chat.sampling import Sampling
from h2o_chat.scheduler import BatchScheduler, TakeTurns, forward_one, forward_pieces

from .helpers import (GREEDY, assert_at_rest_within_budget, assert_consistent, fail_next_forward, h2o,
                      together)

# Four conversations unlike each other in every way a row can differ.
ROWS = [
    dict(policy="h2o", heavy=6, recent=6, sink=2, prompt=40, pin=(3, 9)),
    dict(policy="full", prompt=13, pin=None),
    dict(policy="sink", recent=10, sink=4, prompt=27, pin=None),
    dict(policy="h2o", heavy=16, recent=8, sink=0, prompt=9, pin=(0, 4), rolling=True, score_norm="mean"),
]


def new_cache(model, row):
    budgets = {k: v for k, v in row.items() if k not in ("policy", "prompt", "pin", "rolling", "turns")}
    cache = make_cache(model, row["policy"], rolling=row.get("rolling", False), **budgets)
    if row["pin"]:
        cache.protect(*row["pin"])
    for start in row.get("turns", ()):
        cache.mark_turn(start)
    return cache


def read_prompt(model, cache, prompt):
    """``forward_one`` over a fresh cache's prompt, in passes that end where turns begin,
    as a session feeds them."""
    start = 0
    while start < prompt.shape[1]:
        turn = cache.turn_start_after(start)
        end = prompt.shape[1] if turn is None else min(turn, prompt.shape[1])
        logits = forward_one(model, cache, prompt[:, start:end])
        start = end
    return logits


def kept(cache):
    return [layer.positions.tolist() for layer in cache.stats().layers]


def prompts(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (1, row["prompt"]), generator=generator) for row in ROWS]


def decode_alone(model, row, prompt, steps):
    cache = new_cache(model, row)
    with torch.inference_mode():
        logits = read_prompt(model, cache, prompt)
        tokens = []
        for _ in range(steps):
            tokens.append(int(logits.argmax()))
            logits = forward_one(model, cache, torch.tensor([[tokens[-1]]]))
    return tokens, kept(cache)


@pytest.mark.parametrize("pad", [False, True])
def test_a_batch_of_four_unlike_rows_decodes_as_each_alone(tiny_model, pad):
    """``pad``: the rows padded to a captured step's batch size, as on CUDA (5 rows: 6)."""
    steps = 30
    caches = [new_cache(tiny_model, row) for row in ROWS]
    step = DecodeStep(graphs=False, pad=pad)
    with torch.inference_mode():
        logits = [forward_one(tiny_model, cache, prompt) for cache, prompt in zip(caches, prompts())]
        tokens = [[] for _ in ROWS]
        for _ in range(steps):
            for row, row_logits in enumerate(logits):
                tokens[row].append(int(row_logits.argmax()))
            logits = step(tiny_model, caches, [t[-1] for t in tokens])
    for row, prompt in enumerate(prompts()):
        alone_tokens, alone_kept = decode_alone(tiny_model, ROWS[row], prompt, steps)
        assert tokens[row] == alone_tokens, f"row {row}"
        assert kept(caches[row]) == alone_kept, f"row {row}"
    held = [c.stats().held for c in caches]
    assert len(set(held)) == len(held)  # the rows really held different numbers of slots


def test_rows_join_and_leave_between_steps(tiny_model):
    """Row 1 joins after 5 steps and row 2 leaves after 10: each still decodes as alone."""
    caches = [new_cache(tiny_model, row) for row in ROWS[:3]]
    last, tokens, step = {}, {0: [], 1: [], 2: []}, DecodeStep()
    with torch.inference_mode():
        for row in (0, 2):
            last[row] = forward_one(tiny_model, caches[row], prompts()[row])
        for at in range(20):
            if at == 5:
                last[1] = forward_one(tiny_model, caches[1], prompts()[1])
            if at == 10:
                del last[2]
            rows = sorted(last)
            for row in rows:
                tokens[row].append(int(last[row].argmax()))
            out = step(tiny_model, [caches[r] for r in rows], [tokens[r][-1] for r in rows])
            last = dict(zip(rows, out))
    for row, steps in ((0, 20), (1, 15), (2, 10)):
        assert (tokens[row], kept(caches[row])) == decode_alone(tiny_model, ROWS[row], prompts()[row], steps)


# Rows coming and going: (row of CHURN, first step, steps), several starting and ending
# at one step, in pools of three layouts (float slots, K8/V4 slots, a full cache's).
CHURN = ROWS + [dict(policy="h2o", heavy=8, recent=4, sink=2, prompt=21, pin=None, key_bits=8, value_bits=4),
                dict(policy="turns", heavy=6, recent=4, sink=1, prompt=36, pin=(2, 5), turns=(20,))]
COMINGS = [(0, 0, 14), (1, 0, 6), (2, 2, 9), (3, 3, 3), (4, 3, 11), (5, 6, 8), (0, 6, 5), (2, 11, 4)]


@pytest.mark.parametrize("pad", [False, True])
def test_rows_coming_and_going_at_many_steps_each_decode_as_alone(tiny_model, pad):
    """Rows join and leave at most steps, several at once, as turns start and end on a
    server: the rows going on are carried from step to step, and each row still gives
    the tokens and keeps the slots it does alone."""
    generator = torch.Generator().manual_seed(7)
    prompt = [torch.randint(0, 128, (1, CHURN[row]["prompt"]), generator=generator) for row, _, _ in COMINGS]
    caches = [new_cache(tiny_model, CHURN[row]) for row, _, _ in COMINGS]
    step, last, tokens = DecodeStep(pad=pad), {}, [[] for _ in COMINGS]
    with torch.inference_mode():
        for at in range(20):
            for index, (_, start, steps) in enumerate(COMINGS):
                if at == start:
                    last[index] = read_prompt(tiny_model, caches[index], prompt[index])
                    caches[index].fit_for_decoding()
                if at == start + steps:  # its turn ends: its cache leaves the step
                    del last[index]
                    step.release(caches[index])
            if not last:
                continue
            rows = sorted(last)
            for index in rows:
                tokens[index].append(int(last[index].argmax()))
            last = dict(zip(rows, step(tiny_model, [caches[i] for i in rows], [tokens[i][-1] for i in rows])))
    assert not last and all(len(pool) == 0 for pool in step.pools)
    for index, (row, _, steps) in enumerate(COMINGS):
        assert (tokens[index], kept(caches[index])) == decode_alone(tiny_model, CHURN[row], prompt[index], steps), index


def test_a_row_joining_plans_itself_alone(tiny_model, monkeypatch):
    """Sixteen rows decode; one leaves and another joins: the next step plans the one
    that joined from its cache, and the fifteen going on from their last plans."""
    from h2o_chat.engine import batch

    row = dict(policy="h2o", heavy=6, recent=6, sink=2, prompt=30, pin=None)
    generator = torch.Generator().manual_seed(9)
    caches = [new_cache(tiny_model, row) for _ in range(17)]
    step = DecodeStep()
    with torch.inference_mode():
        for cache in caches:
            forward_one(tiny_model, cache, torch.randint(0, 128, (1, row["prompt"]), generator=generator))
            cache.fit_for_decoding()
        for _ in range(3):
            step(tiny_model, caches[:16], [5] * 16)
        planned = []
        plan_row = batch.plan_row
        monkeypatch.setattr(batch, "plan_row", lambda cache, token: planned.append(cache) or plan_row(cache, token))
        step.release(caches[3])
        rows = caches[:3] + caches[4:]
        step(tiny_model, rows, [5] * 16)
        assert planned == [caches[16]]
        step(tiny_model, rows, [5] * 16)
        assert planned == [caches[16]]


def test_a_row_joining_and_one_leaving_look_at_those_two_only(tiny_model, monkeypatch):
    """The step after one row leaves and another joins asks the caches as many questions
    (their slot groups, whether they still lie in their rows) with 32 rows going on as
    with 4: the rows going on are not looked at again (at 512 rows, looking cost a pass
    with one row coming and one going more than the pass itself)."""
    from h2o_chat.engine.cache import H2OCache

    row = dict(policy="h2o", heavy=6, recent=6, sink=2, prompt=30, pin=None)
    asked = []
    for method in ("whole_group", "stacked"):
        asked_of = getattr(H2OCache, method)
        monkeypatch.setattr(H2OCache, method, lambda self, asked_of=asked_of: asked.append(self) or asked_of(self))

    def questions(rows: int) -> int:
        generator = torch.Generator().manual_seed(11)
        caches = [new_cache(tiny_model, row) for _ in range(rows + 1)]
        step = DecodeStep()
        with torch.inference_mode():
            for cache in caches:
                forward_one(tiny_model, cache, torch.randint(0, 128, (1, row["prompt"]), generator=generator))
                cache.fit_for_decoding()
            for _ in range(2):
                step(tiny_model, caches[:rows], [5] * rows)
            step.release(caches[1])
            asked.clear()
            step(tiny_model, [caches[0], *caches[2:]], [5] * rows)
        return len(asked)

    assert questions(32) == questions(4)


# Bounded rows that can share a pool: budgets, buffer sizes, pins and policies differ.
POOLED = [ROWS[0], ROWS[2], dict(policy="h2o", heavy=10, recent=4, sink=1, prompt=33, pin=None)]


def test_rows_in_a_pool_decode_as_alone_and_leave_it_owning_their_memory(tiny_model):
    """Row 2 joins the pool after 5 steps and row 0 leaves after 10; the step reads the
    members where they lie in the pool. Each row still decodes as alone, and a row that
    left holds its slots in buffers of its own."""
    generator = torch.Generator().manual_seed(3)
    prompt = [torch.randint(0, 128, (1, row["prompt"]), generator=generator) for row in POOLED]
    caches = [new_cache(tiny_model, row) for row in POOLED]
    step, last, tokens, members = DecodeStep(), {}, {0: [], 1: [], 2: []}, []
    with torch.inference_mode():
        for row in (0, 1):
            last[row] = forward_one(tiny_model, caches[row], prompt[row])
        for at in range(20):
            if at == 5:
                last[2] = forward_one(tiny_model, caches[2], prompt[2])
            if at == 10:
                del last[0]
                step.release(caches[0])
                storage = caches[0].whole_group().buffers["keys"].untyped_storage()
                assert storage.data_ptr() != step.pools[0].buffers["keys"].untyped_storage().data_ptr()
            rows = sorted(last)
            for row in rows:
                tokens[row].append(int(last[row].argmax()))
            out = step(tiny_model, [caches[r] for r in rows], [tokens[r][-1] for r in rows])
            [pool] = step.pools  # bounded rows of float slots: one pool, whatever their policies
            members.append(len(pool))
            last = dict(zip(rows, out))
        for cache in caches:
            step.release(cache)
    assert members == [2] * 5 + [3] * 5 + [2] * 10
    assert len(pool) == 0 and pool.buffers == {}
    for row, steps in ((0, 10), (1, 20), (2, 15)):
        assert (tokens[row], kept(caches[row])) == decode_alone(tiny_model, POOLED[row], prompt[row], steps)
        assert caches[row].whole_group().buffers["keys"].is_contiguous()


# h2o rows of a pool, alike but for budgets, pins, ranking and length, each past its budget
# (its buffers at their peak once its pins are in): they take their tokens in one write per
# buffer for every row, their scores in one addition, and evict in one pass.
SUMMING = [dict(policy="h2o", heavy=6, recent=6, sink=2, prompt=40, pin=(3, 9)),
           dict(policy="h2o", heavy=10, recent=4, sink=1, prompt=33, pin=(35, 38)),  # decoded tokens pinned
           dict(policy="h2o", heavy=8, recent=8, sink=0, prompt=45, pin=(0, 12), score_norm="mean"),
           # Turns closed in the prompt: rows beside plain h2o ones score and rank their own way.
           dict(policy="turns", heavy=8, recent=6, sink=2, prompt=42, pin=None, turns=(10, 30), score_norm="mean"),
           dict(policy="turns", heavy=6, recent=4, sink=1, prompt=36, pin=(2, 5), turns=(20,))]


def test_pooled_rows_written_and_scored_at_once_keep_what_each_keeps_alone(tiny_model, monkeypatch):
    from h2o_chat.engine.layer import H2OLayer

    steps = 25
    generator = torch.Generator().manual_seed(5)
    prompt = [torch.randint(0, 128, (1, row["prompt"]), generator=generator) for row in SUMMING]
    caches = [new_cache(tiny_model, row) for row in SUMMING]
    step, tokens, updates = DecodeStep(), [[] for _ in SUMMING], []
    with torch.inference_mode():
        logits = [read_prompt(tiny_model, cache, ids) for cache, ids in zip(caches, prompt)]
        update = H2OLayer.update
        monkeypatch.setattr(H2OLayer, "update", lambda *args, **kwargs: updates.append(1) or update(*args, **kwargs))
        for _ in range(steps):
            for row, row_logits in enumerate(logits):
                tokens[row].append(int(row_logits.argmax()))
            logits = step(tiny_model, caches, [t[-1] for t in tokens])
        monkeypatch.undo()
    # No layer of any row took its token on its own.
    assert updates == [] and [len(pool) for pool in step.pools] == [len(SUMMING)]
    for row, cache in enumerate(caches):
        alone = new_cache(tiny_model, SUMMING[row])
        with torch.inference_mode():
            read_prompt(tiny_model, alone, prompt[row])
            for token in tokens[row]:
                forward_one(tiny_model, alone, torch.tensor([[token]]))
        assert (tokens[row], kept(cache)) == decode_alone(tiny_model, SUMMING[row], prompt[row], steps)
        for mine, theirs in zip(cache.layers, alone.layers):
            order, their_order = mine.positions.argsort(dim=-1), theirs.positions.argsort(dim=-1)
            assert torch.allclose(mine.scores.gather(-1, order), theirs.scores.gather(-1, their_order), atol=1e-5)
            assert torch.equal(mine.pinned.gather(-1, order), theirs.pinned.gather(-1, their_order))
            assert mine.seen == theirs.seen


def test_a_pool_whose_members_all_left_on_their_own_takes_new_rows(tiny_model):
    """Eight members, all reset meanwhile (their rows stale, none released): the pool
    frees every row, spare ones included, and takes the next batch as alone."""
    row = POOLED[2]
    prompt = torch.randint(0, 128, (1, row["prompt"]), generator=torch.Generator().manual_seed(4))
    step = DecodeStep()
    with torch.inference_mode():
        old = [new_cache(tiny_model, row) for _ in range(8)]
        for cache in old:
            forward_one(tiny_model, cache, prompt)
        for _ in range(2):
            step(tiny_model, old, [5] * 8)
        [pool] = step.pools
        assert len(pool) == 8
        for cache in old:
            cache.reset()
        fresh = [new_cache(tiny_model, row) for _ in range(2)]
        for cache in fresh:
            forward_one(tiny_model, cache, prompt)
        step(tiny_model, fresh, [5, 5])
        tokens = [int(logits.argmax()) for logits in step(tiny_model, fresh, [5, 5])]
    assert step.pools == [pool] and len(pool) == 2
    alone = new_cache(tiny_model, row)
    with torch.inference_mode():
        forward_one(tiny_model, alone, prompt)
        forward_one(tiny_model, alone, torch.tensor([[5]]))
        expected = int(forward_one(tiny_model, alone, torch.tensor([[5]])).argmax())
    assert tokens == [expected, expected]


@pytest.mark.parametrize("model_fixture", ["tiny_model", "smollm"])
def test_prompt_pieces_fed_in_one_pass_keep_what_each_keeps_alone(request, model_fixture):
    """The four unlike rows read their prompts (40, 13, 27 and 9 tokens) and then pieces
    of other lengths, each time in one pass: each row's logits and kept slots are those of
    its pieces fed alone, and it decodes alike; on the tiny model and on the real one."""
    model = request.getfixturevalue(model_fixture)
    model = model[0] if isinstance(model, tuple) else model
    # The real model's logits reach about 30, and a packed pass rounds its sums otherwise
    # than each row's own pass (up to 8e-5 apart on the development machine); a token at
    # a wrong position moves them by whole units.
    tolerance = 1e-5 if model_fixture == "tiny_model" else 1e-3
    generator = torch.Generator().manual_seed(3)
    pieces = [prompts(), [torch.randint(0, 128, (1, n), generator=generator) for n in (7, 12, 3, 10)]]
    alone = [new_cache(model, row) for row in ROWS]
    together = [new_cache(model, row) for row in ROWS]
    with torch.inference_mode():
        for step in pieces:
            expected = [forward_one(model, cache, piece) for cache, piece in zip(alone, step)]
            logits = forward_pieces(model, together, [piece[0].tolist() for piece in step])
            for row in range(len(ROWS)):
                assert torch.allclose(logits[row], expected[row], atol=tolerance)
                assert kept(together[row]) == kept(alone[row])
        for row in range(len(ROWS)):
            token = torch.tensor([[int(expected[row].argmax())]])
            assert torch.equal(forward_one(model, together[row], token).argmax(),
                               forward_one(model, alone[row], token).argmax())
            assert kept(together[row]) == kept(alone[row])


@pytest.mark.parametrize("row", [0, 2, 3])
def test_a_chunk_fed_in_pieces_with_eviction_held_keeps_what_one_pass_keeps(tiny_model, row):
    ids = torch.randint(0, 128, (1, 90), generator=torch.Generator().manual_seed(1))
    whole, pieces = new_cache(tiny_model, ROWS[row]), new_cache(tiny_model, ROWS[row])
    with torch.inference_mode():
        forward_one(tiny_model, whole, ids[:, :30])
        forward_one(tiny_model, pieces, ids[:, :30])
        expected = forward_one(tiny_model, whole, ids[:, 30:])  # one pass of 60 tokens
        pieces.hold_eviction(True)
        for start in range(30, 90, 8):
            logits = forward_one(tiny_model, pieces, ids[:, start : start + 8])
        pieces.hold_eviction(False)
    assert torch.allclose(logits, expected, atol=1e-5)
    assert kept(pieces) == kept(whole)


def test_sessions_in_threads_batch_and_reply_as_alone(smollm):
    model, tokenizer = smollm
    settings = [dict(policy="h2o", heavy=24, recent=24, sink=4), dict(policy="full"),
                dict(policy="sink", recent=40, sink=4), dict(policy="h2o", heavy=40, recent=16, sink=0)]
    messages = ["Name three colours.", "What is the capital of France? Explain briefly why.",
                "Write a haiku about rain.", "Count from one to ten."]

    def chat(runner, index):
        session = ChatSession(model, tokenizer, cache=make_cache(model, **settings[index]), runner=runner)
        reply = "".join(session.send(messages[index], pin=index == 3, **GREEDY))
        return session, reply

    alone = [chat(TakeTurns(model), i) for i in range(4)]
    # A long gather: each step waits for every session in a turn, so which rows batch
    # together does not depend on how busy the machine is.
    scheduler = BatchScheduler(model, gather_s=1.0)
    batched = [None] * 4

    def run(index):
        batched[index] = chat(scheduler, index)

    together(*(lambda i=i: run(i) for i in range(4)))
    assert scheduler.batched_rows > 0  # decode steps really ran as batches
    assert scheduler.batched_pieces > 0  # and prompts were read together
    for (session, reply), (alone_session, alone_reply) in zip(batched, alone):
        assert reply == alone_reply
        assert session.tokens == alone_session.tokens
        assert kept(session.cache) == kept(alone_session.cache)
        assert_consistent(session)


def test_stopping_one_row_leaves_the_others_as_alone(smollm):
    model, tokenizer = smollm
    scheduler = BatchScheduler(model, gather_s=1.0)
    # A budget that holds prompt and reply: when the stopped row leaves depends on thread
    # timing, and so does which rows share each step, whose rounding (about 1e-4 in the
    # logits) can flip a near-tie between two tokens' scores and so one eviction. Without
    # evictions, the replies' greedy margins (0.19 at least) dwarf the rounding.
    sessions = [ChatSession(model, tokenizer, cache=h2o(model, 64, 64),
                            runner=scheduler) for _ in range(3)]
    long = dict(temperature=0, max_new_tokens=40)
    replies = [None] * 3

    def run(index):
        stream = sessions[index].send("Count from one to one hundred in words.", **long)
        received = []
        for chunk in stream:
            received.append(chunk)
            if index == 1 and len(received) == 3:
                sessions[1].stop()
        replies[index] = "".join(received)

    together(*(lambda i=i: run(i) for i in range(3)))
    alone = ChatSession(model, tokenizer, cache=h2o(model, 64, 64),
                        runner=TakeTurns(model))
    expected = "".join(alone.send("Count from one to one hundred in words.", **long))
    assert replies[0] == replies[2] == expected, (replies, expected)
    assert len(sessions[1].reply) < 8 and expected.startswith(replies[1])
    for session in sessions:
        assert_consistent(session)


def test_a_failed_batched_pass_reaches_every_row_and_each_stays_usable(smollm):
    model, tokenizer = smollm
    # A long gather: every decode step waits for both sessions, so the step that fails
    # is surely a batch of the two.
    scheduler = BatchScheduler(model, gather_s=2.0)
    sessions = [ChatSession(model, tokenizer, cache=h2o(model, 24, 24),
                            runner=scheduler) for _ in range(2)]
    errors = [None, None]

    def run(index):
        try:
            stream = sessions[index].send("Count from one to twenty.", temperature=0, max_new_tokens=24)
            for received, _ in enumerate(stream, 1):
                if index == 0 and received == 3:
                    fail_next_forward(model.model.layers[3])
        except RuntimeError as err:
            errors[index] = str(err)

    together(*(lambda i=i: run(i) for i in range(2)))
    assert errors == ["injected failure", "injected failure"]
    for session in sessions:
        assert_consistent(session)
        assert session.messages[-1]["content"]  # the partial reply is kept
        assert "".join(session.send("Thanks!", **GREEDY)).strip()
        assert_consistent(session)


@pytest.mark.parametrize("chunk", [128])
def test_a_long_prefill_does_not_hold_up_the_others(smollm, chunk):
    """While one conversation reads a long paste, one chunk per step, another one's whole
    reply is decoded in between."""
    model, tokenizer = smollm
    scheduler = BatchScheduler(model)
    paste = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(80))
    reader = ChatSession(model, tokenizer, cache=h2o(model, 64, 64),
                         runner=scheduler, prefill_chunk_size=chunk)
    talker = ChatSession(model, tokenizer, cache=h2o(model, 24, 24),
                         runner=scheduler)
    finished = {}

    def read():
        stream = reader.send(paste + "\nHow many lines?", temperature=0, max_new_tokens=2)
        next(stream)
        finished["reader first token"] = scheduler.steps
        list(stream)

    def talk():
        "".join(talker.send("Say hello.", temperature=0, max_new_tokens=8))
        finished["talker reply"] = scheduler.steps

    together(read, talk)
    assert reader.fed > 5 * chunk
    assert finished["talker reply"] < finished["reader first token"]
    # Read in pieces between the talker's steps, the paste left the cache as one pass
    # per chunk leaves it.
    alone = ChatSession(model, tokenizer, cache=h2o(model, 64, 64),
                        runner=TakeTurns(model), prefill_chunk_size=chunk)
    assert "".join(alone.send(paste + "\nHow many lines?", temperature=0, max_new_tokens=2)) == reader.messages[-1]["content"]
    assert alone.tokens == reader.tokens and kept(alone.cache) == kept(reader.cache)


def test_sessions_starting_in_threads_read_the_same_prompt_tokens(smollm):
    """Sessions on one tokenizer start their turns at once: each reads the prompt that one
    session alone reads (the tokenizer is shared, and some of its settings are state)."""
    model, tokenizer = smollm
    message = "Count from one to ten, please."

    def prompt_tokens() -> list[int]:
        session = ChatSession(model, tokenizer, cache=h2o(model, 64, 64), runner=TakeTurns(model))
        "".join(session.send(message, temperature=0, max_new_tokens=1))
        return session.tokens[: len(session.tokens) - len(session.reply)]  # the prompt

    expected = prompt_tokens()
    read = []
    together(*(lambda: read.extend(prompt_tokens() for _ in range(15)) for _ in range(4)))
    assert len(read) == 60 and all(tokens == expected for tokens in read)


PASTE = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(40))


def test_a_turn_stopped_before_it_began_feeds_nothing(smollm):
    """A stop event set before the turn starts (a client gone while its request waited)
    ends it before its first forward pass; the session stays usable."""
    model, tokenizer = smollm
    session = ChatSession(model, tokenizer, cache=h2o(model, 24, 24), runner=BatchScheduler(model))
    stop = threading.Event()
    stop.set()
    assert "".join(session.send(PASTE, stop=stop, **GREEDY)) == ""
    assert (session.fed, session.stats().cache.seen, session.finish_reason) == (0, 0, None)
    assert "".join(session.send("Say hello.", **GREEDY)).strip()
    assert_consistent(session)


def test_a_prefill_stopped_between_two_pieces_keeps_what_it_fed_and_continues(smollm):
    """A stop set while a prompt chunk is read ends the turn after the piece under way,
    not after the chunk: the cache holds that piece, evicted to its budget, the session
    counts it as fed, and continuing reads the rest. (A story: a chat takes back a turn
    stopped before its reply's first token.)"""
    model, tokenizer = smollm
    scheduler = BatchScheduler(model)
    story = StorySession(model, tokenizer, cache=h2o(model, 24, 24), runner=scheduler, prefill_chunk_size=256)
    stop = threading.Event()
    hook = model.register_forward_hook(lambda *_: stop.set())  # during the first piece
    try:
        assert "".join(story.send(PASTE, stop=stop, **GREEDY)) == ""
    finally:
        hook.remove()
    assert story.finish_reason == "stopped"
    assert story.fed == story.stats().cache.seen == scheduler.prefill_piece < 256
    assert_at_rest_within_budget(story)
    assert "".join(story.send(**GREEDY)).strip()
    assert story.fed > 256
    assert_consistent(story)


@pytest.mark.parametrize("stopped_in", ["the queue", "the prefill"])
def test_a_chat_turn_stopped_before_its_reply_began_is_taken_back(smollm, stopped_in):
    """Stopped before its reply's first token, waiting or while its message is read, a
    turn leaves the conversation as it was: no empty assistant turn, which the model
    would read as the way to answer (after one, every later reply came out empty). The
    next message is answered as if the stopped one had never been sent: the same tokens
    and reply as a chat that never saw it."""
    model, tokenizer = smollm
    scheduler = BatchScheduler(model)

    def chat() -> ChatSession:
        return ChatSession(model, tokenizer, cache=h2o(model, 24, 24), runner=scheduler, prefill_chunk_size=256)

    session, never = chat(), chat()
    for each in (session, never):
        "".join(each.send("Name a colour.", **GREEDY))
    stop = threading.Event()
    hook = None
    if stopped_in == "the queue":
        stop.set()
    else:
        hook = model.register_forward_hook(lambda *_: stop.set())  # during the message's first piece
    try:
        assert "".join(session.send(PASTE, pin=True, stop=stop, **GREEDY)) == ""
    finally:
        if hook is not None:
            hook.remove()
    assert session.messages == never.messages and session.tokens == never.tokens
    assert session.finish_reason == never.finish_reason == "end" and session.pins() == never.pins()
    reply = "".join(session.send("Name a fruit.", **GREEDY))
    assert reply == "".join(never.send("Name a fruit.", **GREEDY)) and reply.strip()
    assert session.tokens == never.tokens and session.messages == never.messages
    assert_consistent(session)


def _stream_counts(model, quiet_s: float) -> list[tuple[list[int], list[int]]]:
    """Three generations batched, each read in a thread of its own: the counts each
    reader was handed and the tokens each drew."""
    scheduler = BatchScheduler(model, gather_s=1.0, wake_per_row_s=quiet_s, wake_max_s=quiet_s)
    generations = [Generation(new_cache(model, row), prompt[0].tolist(), 0, Sampling(max_new_tokens=12, temperature=0),
                              chunk=64, reply=[]) for row, prompt in zip(ROWS[:3], prompts()[:3])]
    counts: list[list[int]] = [[] for _ in generations]

    def read(index: int) -> None:
        counts[index] = list(scheduler.generate(generations[index]))

    together(*(lambda i=i: read(i) for i in range(3)))
    return [(each, generation.reply) for each, generation in zip(counts, generations)]


def test_tokens_drawn_soon_after_a_readers_wake_up_reach_it_with_the_next(tiny_model):
    """A reader woken less than the quiet time ago is not woken again: the tokens drawn
    meanwhile reach it with the next wake-up, and the generation's end always wakes it.
    The tokens drawn are those of readers woken on every token."""
    every_token = _stream_counts(tiny_model, 0.0)
    quiet = _stream_counts(tiny_model, 3600.0)
    for (counts, reply), (quiet_counts, quiet_reply) in zip(every_token, quiet):
        assert counts == list(range(1, 13))
        assert quiet_counts == [1, 12]  # the first token, then the end
        assert quiet_reply == reply


def test_a_reader_woken_for_several_tokens_at_once_streams_the_text_of_one_woken_for_each(smollm):
    """Replies that end at the end of the turn (a multi-byte character in one) and at the
    length limit: the same text and tokens, in at most two pieces."""
    model, tokenizer = smollm
    messages = ["Write the word 'café' with an emoji.", "Name three colours.",
                "How do you write 'thank you' in Japanese? Answer in one line."]

    def chat_all(quiet_s: float) -> list[tuple[list[str], ChatSession]]:
        scheduler = BatchScheduler(model, gather_s=1.0, wake_per_row_s=quiet_s, wake_max_s=quiet_s)
        out: list = [None] * len(messages)

        def chat(index: int) -> None:
            session = ChatSession(model, tokenizer, cache=h2o(model, 24, 24), runner=scheduler)
            out[index] = (list(session.send(messages[index], temperature=0, max_new_tokens=40)), session)

        together(*(lambda i=i: chat(i) for i in range(len(messages))))
        return out

    every_token, quiet = chat_all(0.0), chat_all(3600.0)
    assert {session.finish_reason for _, session in quiet} == {"end", "length"}
    for (pieces, session), (quiet_pieces, quiet_session) in zip(every_token, quiet):
        assert "".join(quiet_pieces) == "".join(pieces) and "".join(pieces).strip()
        assert len(quiet_pieces) <= 2 < len(pieces)
        assert quiet_session.tokens == session.tokens and quiet_session.reply == session.reply
        assert quiet_session.finish_reason == session.finish_reason
        assert_consistent(quiet_session)


def test_a_closed_scheduler_stops_its_rows_and_its_worker_lets_go_of_them(tiny_model):
    """``close``: the generation running ends as stopped with what it drew, its cache
    freed as soon as the caller drops it (the worker holds nothing of it), and one asked
    for afterwards ends at once, never waiting for a worker."""
    scheduler = BatchScheduler(tiny_model)
    running = Generation(new_cache(tiny_model, ROWS[0]), prompts()[0][0].tolist(), 0,
                         Sampling(max_new_tokens=10_000, temperature=0), chunk=64, reply=[])
    stream = scheduler.generate(running)
    assert next(stream) == 1
    scheduler.close()
    rest = list(stream)  # what was drawn before the stop, up to the whole reply
    assert running.finish == "stopped" and 0 < len(running.reply) < 10_000
    assert rest == sorted(set(rest)) and (rest or [1])[-1] == len(running.reply)
    freed = weakref.ref(running.cache)
    del running, stream
    gc.collect()
    assert freed() is None
    late = Generation(new_cache(tiny_model, ROWS[1]), [1, 2, 3], 0, Sampling(max_new_tokens=4), chunk=64, reply=[])
    assert list(scheduler.generate(late)) == [] and late.finish == "stopped" and late.reply == []
