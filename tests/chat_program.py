"""A program that uses ``ChatSession`` as a user's script does, prints what it got and
returns (``tests/test_exit.py`` runs it): greedy replies, a bad input refused, two
sessions replying in two threads, and last a reply stopped with ``stop()`` after 5
chunks whose stream the program still holds as it returns, so the scheduler's worker
may be finishing the step under way while the interpreter finalizes."""

import threading

from h2o_chat import ChatSession, load_model, make_cache
from h2o_chat.inputs import InputError

model, tokenizer = load_model()


def session() -> ChatSession:
    return ChatSession(model, tokenizer, cache=make_cache(model, "h2o", heavy=24, recent=24, sink=4),
                       system_prompt="Be brief.")


chat = session()
for text in ("Hi!", "Name a colour."):
    print("reply:", "".join(chat.send(text, temperature=0, max_new_tokens=8)))
try:
    chat.send("   ")
except InputError as err:
    print("refused:", err)

replies = {}


def reply(word: str) -> None:
    replies[word] = "".join(session().send(f"Say {word}.", temperature=0, max_new_tokens=8))


threads = [threading.Thread(target=reply, args=(word,)) for word in ("yes", "no")]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print("two threads:", sorted(replies))

chunks = []
stream = chat.send("Count from one to fifty in words.", temperature=0, max_new_tokens=200)
for chunk in stream:
    chunks.append(chunk)
    if len(chunks) == 5:
        chat.stop()
        break
print("stopped after", len(chunks), "chunks")
