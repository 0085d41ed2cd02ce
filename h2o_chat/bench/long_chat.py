"""Comparison 5: a long chat. MT-Bench's questions (both turns, in file order) go through
ONE ``ChatSession`` per policy, greedy replies capped at ``max_new_tokens``.

Turn 0 states a fact (a name and a number); right after it (the baseline: can the model
answer at all?) and after 10, 20 and 40 further turns, two probes ask for the name and
for the number. A probe runs on a deep copy of the session's cache, so it never changes
the conversation the other numbers come from. "Protected" runs pin the fact message as it is
sent (``session.send(FACT, pin=True)``: its content's tokens, not the template around it); the
system prompt is protected in every run, the app's default.

Recorded after every turn: slots held, KV bytes (allocated and in use), tokens seen, and
the turn's wall time (prefill + decode).
"""

from __future__ import annotations

import copy
import time

import torch
from torch.nn import functional as F

from h2o_chat.engine.budget import TURNS_RECENT_SHARE, split_slots, token_bytes
from h2o_chat.engine.build import make_cache
from h2o_chat.engine.quant import KVStorage
from h2o_chat.sessions import ChatSession

from . import data
from .metrics import token_nll
from .variants import bench_cache

FACT = "Before we start, please remember this: my name is Marisol Quentaro and my locker code is 4817."
# Asked separately: the 135M model answers "What is my name?" right after the fact but
# not a combined question.
PROBES = {"name": "What is my name?", "code": "What is my locker code?"}
# The true answers, scored token by token (teacher forcing) after each probe's question:
# a small model may fail to say the answer even with everything cached, but the
# likelihood it gives the answer still shows whether the fact's tokens are there to use.
ANSWERS = {"name": "Your name is Marisol Quentaro.", "code": "Your locker code is 4817."}
PROBE_AFTER = (0, 10, 20, 40)


def recalled(kind: str, answer: str) -> bool:
    if kind == "name":
        return "quentaro" in answer.lower() or "marisol" in answer.lower()
    return "4817" in answer


def probe(session: ChatSession, question: str, answer: str, max_new_tokens: int = 24) -> tuple[str, float]:
    """The greedy answer to ``question`` and the mean negative log-likelihood of the true
    ``answer`` given it, each from its own copy of the session's state. The question
    opens a turn as a sent message does (a turn-aware cache closes the last one there)."""
    tok, model = session.tokenizer, session.model
    cache = copy.deepcopy(session.cache)
    rendered = tok.apply_chat_template(session.messages + [{"role": "user", "content": question}],
                                       tokenize=False, add_generation_prompt=True)
    assert rendered.startswith(session.template_text)
    tail = rendered[len(session.template_text):]
    unfed = session.tokens[session.fed:]
    before_question = tok(tail[: tail.rindex(question)], add_special_tokens=False).input_ids
    new = unfed + tok(tail, add_special_tokens=False).input_ids
    assert new[: len(unfed) + len(before_question)] == unfed + before_question
    cache.mark_turn(session.fed + len(unfed) + len(before_question))
    out = []
    with torch.inference_mode():
        ids, fed = torch.tensor([new]), session.fed
        while fed < session.fed + len(new):  # in pieces of 256 that end where a turn begins
            turn = cache.turn_start_after(fed)
            end = min(fed + 256, session.fed + len(new), turn if turn is not None else fed + 256)
            logits = model(input_ids=ids[:, fed - session.fed : end - session.fed], past_key_values=cache,
                           use_cache=True, logits_to_keep=1).logits[:, -1]
            fed = end
        forced = copy.deepcopy(cache)
        first = logits
        for _ in range(max_new_tokens):
            token = int(logits.argmax(-1))
            if token in session.eos_ids:
                break
            out.append(token)
            logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[:, -1]
        targets = torch.tensor([tok(answer, add_special_tokens=False).input_ids])
        rest = model(input_ids=targets[:, :-1], past_key_values=forced, use_cache=True).logits
        answer_logits = torch.cat([first[:, None], rest], dim=1)
        nll = token_nll(F.log_softmax(answer_logits.float(), dim=-1), targets)
    return tok.decode(out, skip_special_tokens=True), float(nll.mean())


def chat_run(model, tokenizer, label: str, cache, user_turns: list[str], max_new_tokens: int,
             protect_first: bool, probes: dict[str, tuple[str, str]], probe_after: tuple[int, ...],
             log=print) -> dict:
    """One session through ``user_turns``; after turn ``n in probe_after`` (0: the first)
    every probe ``kind: (question, true answer)`` asks its question on a copy."""
    session = ChatSession(model, tokenizer, cache=cache)
    turns, results = [], []
    budget = None
    for turn, text in enumerate(user_turns):
        started = time.perf_counter()
        reply = "".join(session.send(text, pin=protect_first and turn == 0, max_new_tokens=max_new_tokens,
                                     temperature=0))
        seconds = time.perf_counter() - started
        stats = session.cache.stats()
        budget = stats.budget
        turns.append({"turn": turn, "seconds": seconds, "held": stats.held, "kv_bytes": stats.kv_bytes,
                      "held_bytes": stats.held_bytes, "seen": stats.seen, "budget": stats.budget,
                      "pinned": stats.pinned, "reply_tokens": len(session.reply)})
        if turn == 0:
            turns[-1]["reply"] = reply
        if turn in probe_after:
            for kind, (question, answer) in probes.items():
                said, nll = probe(session, question, answer)
                results.append({"after_turns": turn, "kind": kind, "answer": said,
                                "recalled": recalled(kind, said) if kind in PROBES else None, "answer_nll": nll})
        if turn % 10 == 0:
            log(f"  chat {label}: turn {turn}/{len(user_turns) - 1} held {stats.held} seen {stats.seen} "
                f"({seconds:.1f}s)")
    return {"label": label, "budget": budget, "protect_fact": protect_first, "turns": turns, "probes": results,
            "policy": session.cache.stats().policy}


def chat_caches(model, budget: int, sink: int) -> dict[str, tuple]:
    """Every run's cache maker, by label, and whether it pins its first message: slots
    split as the app splits a byte budget, and the same bytes at K8/V4 (about four
    times the slots)."""
    float_bytes = budget * token_bytes(model, KVStorage(), rolling=False)

    def slots(policy: str, **extra):
        split = split_slots(policy, budget, sink)
        return lambda: make_cache(model, policy, **split, **extra)

    def same_bytes(policy: str, **extra):
        return lambda: make_cache(model, policy, budget_bytes=float_bytes, sink=sink, key_bits=8, value_bits=4,
                                  **extra)

    window = (budget - sink) // TURNS_RECENT_SHARE
    return {
        "full": (lambda: make_cache(model, "full"), False),
        "h2o": (slots("h2o"), False),
        "h2o pinned": (slots("h2o"), True),
        # Plain h2o with the turns policy's window: what the window alone changes.
        "h2o recent/16": (lambda: make_cache(model, "h2o", sink=sink, recent=window, heavy=budget - sink - window),
                          False),
        "turns": (slots("turns"), False),
        "turns mean": (slots("turns", score_norm="mean"), False),
        "sink": (slots("sink"), False),
        "recent": (slots("recent"), False),
        "h2o K8/V4": (same_bytes("h2o"), False),
        "turns K8/V4": (same_bytes("turns"), False),
    }


RUN_LABELS = ("full", "h2o", "h2o pinned", "h2o recent/16", "turns", "turns mean", "sink", "recent", "h2o K8/V4",
              "turns K8/V4")
FACT_RUNS = ("full", "h2o", "h2o pinned", "h2o recent/16", "turns", "turns mean", "h2o K8/V4", "turns K8/V4")
CALLBACK_RUNS = ("full", "h2o", "turns", "turns mean")
CALLBACK_AFTER = (0, 10, 20)
# Said before an early question's second turn, which refers to "the above question".
CALLBACK = "Back to the first problem I gave you. "


def callback_sets(questions: list[dict], count: int) -> list[tuple[dict, list[str]]]:
    """MT-Bench's second turns asked about the first after other turns: ``count``
    math, reasoning and coding questions whose second turn has a reference answer (it
    needs the first turn's details), each with the filler turns that follow its first
    turn, both turns of the questions without references, a different stretch each."""
    early = [q for q in questions if q["category"] in ("math", "reasoning", "coding")
             and len(q.get("reference", [])) > 1 and q["reference"][1].strip()]
    early = [early[round(i * (len(early) - 1) / max(1, count - 1))] for i in range(count)]
    filler = [t for q in questions if not q.get("reference") for t in q["turns"]]
    need = max(CALLBACK_AFTER)
    return [(q, [filler[(i * need + k) % len(filler)] for k in range(need)]) for i, q in enumerate(early)]


def run(model, tokenizer, n_questions: int, max_new_tokens: int, budget: int = 512, sink: int = 4,
        runs: tuple[str, ...] = FACT_RUNS, callbacks: int = 8, callback_runs: tuple[str, ...] = CALLBACK_RUNS,
        extra=None, log=print) -> dict:
    """The fact set (a fact, then MT-Bench, probes after ``PROBE_AFTER`` turns) for every
    run in ``runs``; and, where ``callbacks``, the second set (``callback_sets``) for
    every run in ``callback_runs``."""
    questions = data.mt_bench_questions(n_questions)
    user_turns = [FACT] + [t for q in questions for t in q["turns"]]
    makers = chat_caches(model, budget, sink)
    unknown = (set(runs) | set(callback_runs)) - set(makers)
    if unknown:
        raise ValueError(f"unknown chat runs {sorted(unknown)}; known: {', '.join(makers)}")
    configs = [(label, *makers[label]) for label in runs]
    if extra is not None:
        v = extra(budget)
        configs.append((v.label, lambda: bench_cache(model, [v]), False))
    fact_probes = {kind: (question, ANSWERS[kind]) for kind, question in PROBES.items()}
    results = []
    for label, make, protect in configs:
        started = time.perf_counter()
        results.append(chat_run(model, tokenizer, label, make(), user_turns, max_new_tokens, protect,
                                fact_probes, PROBE_AFTER, log))
        log(f"  chat {label}: {len(user_turns)} turns in {time.perf_counter() - started:.0f}s")
    callback_results = {}
    sets = callback_sets(data.mt_bench_questions(), callbacks) if callbacks else []
    for label in callback_runs if sets else ():
        make = makers[label][0]
        started = time.perf_counter()
        per_question = []
        for question, filler in sets:
            asked = {"callback": (CALLBACK + question["turns"][1], question["reference"][1])}
            one = chat_run(model, tokenizer, label, make(), [question["turns"][0], *filler], max_new_tokens,
                           False, asked, CALLBACK_AFTER, log=lambda *_: None)
            per_question.append({"question_id": question["question_id"],
                                 "nll": [p["answer_nll"] for p in one["probes"]]})  # by CALLBACK_AFTER
        callback_results[label] = per_question
        log(f"  callbacks {label}: {len(sets)} questions in {time.perf_counter() - started:.0f}s")
    splits = {policy: split_slots(policy, budget, sink) for policy in ("h2o", "turns", "sink", "recent")}
    notes = [
        f"{len(questions)} MT-Bench questions x 2 turns after a fact turn = {len(user_turns)} turns per "
        f"session; greedy replies of at most {max_new_tokens} tokens; budget {budget} float32 slots split as "
        f"the app splits a byte budget ({'; '.join(f'{k}: {v}' for k, v in splits.items())}); K8/V4 runs: the "
        "same bytes with 8-bit keys and 4-bit values; the system prompt is protected (pinned) in every run, "
        "adding its tokens to the slots held; \"h2o pinned\" also pins the fact message's tokens "
        "(session.send(..., pin=True)).",
        f"Recall probes: turn 0 says \"{FACT}\"; after turns {', '.join(map(str, PROBE_AFTER))} a copy of the "
        f"session is asked \"{PROBES['name']}\" (name: the answer contains Marisol or Quentaro) and "
        f"\"{PROBES['code']}\" (code: it contains 4817). After turn 0 is the baseline: what the model "
        "recalls with nothing evicted. Answer NLL: mean negative log-likelihood (nats per token) of the true "
        f"answers {ANSWERS['name']!r} / {ANSWERS['code']!r} after the question, teacher-forced.",
        "KV MB in use counts the slots held (keys, values, scores, positions, flags); allocated adds the room "
        "reserved for incoming tokens: budget + one prefill chunk for a bounded cache, doubling buffers for full.",
    ]
    if sets:
        notes.append(
            f"Callbacks (the second set): {len(sets)} MT-Bench questions whose second turn has a reference answer "
            f"({', '.join(str(q['question_id']) for q, _ in sets)}); each its own session: its first turn, then "
            f"{max(CALLBACK_AFTER)} turns of the questions without references; after {', '.join(map(str, CALLBACK_AFTER))} "
            f"of them a copy is asked {CALLBACK!r} + its second turn, and scored on the reference answer "
            "(NLL, nats/token, mean over the questions).")
    for run_ in results:
        for p in run_["probes"]:
            notes.append(f"- {run_['label']}, after turn {p['after_turns']}, {p['kind']}: {p['answer']!r}")
    return {"runs": results, "callbacks": callback_results, "notes": notes,
            "config": {"questions": len(questions), "max_new_tokens": max_new_tokens, "budget": budget,
                       "sink": sink, "fact": FACT, "probes": PROBES, "probe_after": list(PROBE_AFTER),
                       "callback_after": list(CALLBACK_AFTER), "callbacks": callbacks}}
