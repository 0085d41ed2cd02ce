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

from h2o_chat.engine.build import make_cache
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
    ``answer`` given it, each from its own copy of the session's state."""
    tok, model = session.tokenizer, session.model
    cache = copy.deepcopy(session.cache)
    rendered = tok.apply_chat_template(session.messages + [{"role": "user", "content": question}],
                                       tokenize=False, add_generation_prompt=True)
    assert rendered.startswith(session.template_text)
    new = session.tokens[session.fed:] + tok(rendered[len(session.template_text):], add_special_tokens=False).input_ids
    out = []
    with torch.inference_mode():
        ids = torch.tensor([new])
        for piece in ids.split(256, dim=1):
            logits = model(input_ids=piece, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
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
             protect_fact: bool, log=print) -> dict:
    session = ChatSession(model, tokenizer, cache=cache)
    turns, probes = [], []
    budget = None
    for turn, text in enumerate([FACT] + user_turns):
        started = time.perf_counter()
        reply = "".join(session.send(text, pin=protect_fact and turn == 0, max_new_tokens=max_new_tokens,
                                     temperature=0))
        seconds = time.perf_counter() - started
        stats = session.cache.stats()
        budget = stats.budget
        turns.append({"turn": turn, "seconds": seconds, "held": stats.held, "kv_bytes": stats.kv_bytes,
                      "held_bytes": stats.held_bytes, "seen": stats.seen, "budget": stats.budget,
                      "pinned": stats.pinned, "reply_tokens": len(session.reply)})
        if turn == 0:
            turns[-1]["reply"] = reply
        if turn in PROBE_AFTER:
            for kind, question in PROBES.items():
                answer, nll = probe(session, question, ANSWERS[kind])
                probes.append({"after_turns": turn, "kind": kind, "answer": answer,
                               "recalled": recalled(kind, answer), "answer_nll": nll})
        if turn % 10 == 0:
            log(f"  chat {label}: turn {turn}/{len(user_turns)} held {stats.held} seen {stats.seen} "
                f"({seconds:.1f}s)")
    return {"label": label, "budget": budget, "protect_fact": protect_fact, "turns": turns, "probes": probes,
            "policy": session.cache.stats().policy}


def run(model, tokenizer, n_questions: int, max_new_tokens: int, budget: int = 512, sink: int = 4,
        extra=None, log=print) -> dict:
    questions = data.mt_bench_questions(n_questions)
    user_turns = [t for q in questions for t in q["turns"]]
    heavy = (budget - sink) // 2
    recent = budget - sink - heavy
    configs = [
        ("full", lambda: make_cache(model, "full"), False),
        ("h2o", lambda: make_cache(model, "h2o", heavy=heavy, recent=recent, sink=sink), False),
        ("h2o, fact protected", lambda: make_cache(model, "h2o", heavy=heavy, recent=recent, sink=sink), True),
        ("sink", lambda: make_cache(model, "sink", sink=sink, recent=budget - sink), False),
        ("recent", lambda: make_cache(model, "recent", recent=budget), False),
    ]
    if extra is not None:
        v = extra(budget)
        configs.append((v.label, lambda: bench_cache(model, [v]), False))
    runs = []
    for label, make, protect in configs:
        started = time.perf_counter()
        runs.append(chat_run(model, tokenizer, label, make(), user_turns, max_new_tokens, protect, log))
        log(f"  chat {label}: {len(user_turns) + 1} turns in {time.perf_counter() - started:.0f}s")
    notes = [
        f"{len(questions)} MT-Bench questions x 2 turns after a fact turn = {len(user_turns) + 1} turns per "
        f"session; greedy replies of at most {max_new_tokens} tokens; budget {budget} slots "
        f"(h2o: sink {sink}, heavy {heavy}, recent {recent}; sink: {sink} + {budget - sink}; recent: {budget}); "
        "the system prompt is protected (pinned) in every run, adding its tokens to the slots held; "
        "\"fact protected\" also pins the fact message's tokens (session.send(..., pin=True)).",
        f"Recall probes: turn 0 says \"{FACT}\"; after turns {', '.join(map(str, PROBE_AFTER))} a copy of the "
        f"session is asked \"{PROBES['name']}\" (name: the answer contains Marisol or Quentaro) and "
        f"\"{PROBES['code']}\" (code: it contains 4817). After turn 0 is the baseline: what the model "
        "recalls with nothing evicted. Answer NLL: mean negative log-likelihood (nats per token) of the true "
        f"answers {ANSWERS['name']!r} / {ANSWERS['code']!r} after the question, teacher-forced.",
        "KV MB in use counts the slots held (keys, values, scores, positions, flags); allocated adds the room "
        "reserved for incoming tokens: budget + one prefill chunk for a bounded cache, doubling buffers for full.",
    ]
    for run_ in runs:
        for p in run_["probes"]:
            notes.append(f"- {run_['label']}, after turn {p['after_turns']}, {p['kind']}: {p['answer']!r}")
    return {"runs": runs, "notes": notes,
            "config": {"questions": len(questions), "max_new_tokens": max_new_tokens, "budget": budget,
                       "sink": sink, "fact": FACT, "probes": PROBES, "probe_after": list(PROBE_AFTER)}}
