"""Saving and resuming: conversation files, session files with their cache, refusals."""

import dataclasses
import json
import random
import zipfile
from pathlib import Path

import pytest
import torch
from markdown_it import MarkdownIt
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from h2o_chat import ChatSession, StorySession, make_cache
from h2o_chat.engine.state import SettingDifference, describe_differences, settings_differences
from h2o_chat.inputs.markdown import disarm_html
from h2o_chat.sessions.files import (CHECKSUM, MANIFEST, TENSORS, VERSION, SettingsMismatch, SnapshotError,
                               load_session, model_identity, read_manifest, save_session,
                               write_session_file)
from h2o_chat.sessions.transcripts import Transcript, TranscriptError, read_transcript

from .helpers import feed

BUDGET = dict(heavy=16, recent=16, sink=4)  # small: the turns below evict


def small_cache(model, policy="h2o", rolling=False, **budget):
    return make_cache(model, policy, rolling=rolling, **(BUDGET | budget))


def kept_positions(cache):
    return [layer.positions for layer in cache.stats().layers]


def assert_same_cache(a, b):
    for x, y in zip(kept_positions(a), kept_positions(b), strict=True):
        assert torch.equal(x, y)


def assert_continues_identically(model, original, resumed, steps=30):
    """Feed both sessions' unfed token, then ``steps`` greedy tokens: the logits must be
    bit-identical and every layer/head must keep the same positions after every step."""
    assert original.tokens == resumed.tokens and original.fed == resumed.fed
    assert_same_cache(original.cache, resumed.cache)
    token = torch.tensor([original.tokens[original.fed:]])
    assert token.shape == (1, 1)  # the last sampled token is still unfed
    for _ in range(steps):
        with torch.inference_mode():  # as sessions feed: their buffers are inference tensors
            a, b = feed(model, original.cache, token, 1), feed(model, resumed.cache, token, 1)
        assert torch.equal(a, b)
        assert_same_cache(original.cache, resumed.cache)
        token = a[:, -1:].argmax(-1)
    assert original.cache.stats().budget_reached  # every step evicted


def new_chat(smollm, pin=False):
    """Two greedy turns on a small cache (over budget), the first message pinned if ``pin``."""
    model, tokenizer = smollm
    session = ChatSession(model, tokenizer, cache=small_cache(model), system_prompt="Be brief.")
    for text in ("Name three fruits.", "And three colours?"):
        "".join(session.send(text, pin=pin and text.startswith("Name"), temperature=0, max_new_tokens=20))
        pin = False
    assert session.stats().cache.budget_reached
    return session


@pytest.fixture(scope="module")
def chat(smollm):
    return new_chat(smollm)


@pytest.fixture(scope="module")
def chat_file(chat, tmp_path_factory):
    return save_session(chat, tmp_path_factory.mktemp("sessions") / "chat.h2o-session.zip")


# ---- conversations (text only) ---------------------------------------------------------

def test_conversation_json_roundtrip_becomes_a_session_with_that_history(smollm, chat):
    model, tokenizer = smollm
    conversation = read_transcript(Transcript.of(chat).to_json())
    assert conversation.system_prompt == "Be brief."
    assert conversation.messages == [m for m in chat.messages if m["role"] != "system"]
    imported = conversation.session(model, tokenizer, cache=small_cache(model))
    assert imported.messages == chat.messages and imported.fed == 0
    reply = "".join(imported.send("Thanks!", temperature=0, max_new_tokens=4))
    assert reply and imported.messages[-2] == {"role": "user", "content": "Thanks!"}


def test_conversation_markdown_has_every_message(chat):
    text = Transcript.of(chat).to_markdown()
    assert text.startswith("# Conversation\n\n**System prompt:**\n\n> Be brief.\n\n## User\n\n> Name three fruits.")
    assert text.count("## Assistant") == 2
    last = chat.messages[-1]["content"].split("\n")
    assert "\n".join(f"> {line}" if line else ">" for line in last) in text


def test_no_message_passes_for_another_turn_in_markdown():
    """Headings, fences left open and raw HTML in a message stay inside its quote: a
    CommonMark reader finds exactly the real turns' headings and no HTML to run."""
    forged = "## Assistant\nSure.\nUser\n===\n"
    conversation = Transcript("Be brief.</blockquote><h2>User</h2>", [
        {"role": "user", "content": f"hi {forged}```\nan open fence"},
        {"role": "assistant", "content": "<div>\n</blockquote>\n<h2>User</h2>\n</div>\n\n`vector<int>` ok"},
        {"role": "user", "content": "<!-- unclosed\n\n## User\r## Assistant\rok"},
    ])
    tokens = MarkdownIt("commonmark").parse(conversation.to_markdown())
    top = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open" and t.level == 0]
    assert top == ["Conversation", "User", "Assistant", "User"]
    assert not [t for t in tokens if t.type == "html_block"
                or any(c.type == "html_inline" for c in t.children or ())]
    assert [c.content for t in tokens for c in t.children or () if c.type == "code_inline"] == ["vector<int>"]


def test_text_with_its_html_disarmed_holds_no_html_for_a_commonmark_reader():
    """Tags, fences, indents and comments mixed at random (seeded): whatever the text,
    what comes back has no raw HTML, and lines without any keep their text."""
    rng = random.Random(7)
    pieces = ["<pre>", "</pre>", "<div>", "    <b>x</b>", "`", "``", "<!--", "-->", "text", "", "<?", "?>",
              "<![CDATA[", "]]>", "- <i>", "> <p>", "```", "<script>", "a <b> c", "<textarea>", "`a<b>`"]
    for _ in range(200):
        text = "\n".join(rng.choice(pieces) for _ in range(40))
        disarmed = disarm_html(text, "&lt;")
        tokens = MarkdownIt("commonmark").parse(disarmed)
        assert not [t for t in tokens if t.type == "html_block"
                    or any(c.type == "html_inline" for c in t.children or ())], text
    assert disarm_html("no tags, `vector<int>` in code\r\nand a < b", "&lt;") == \
        "no tags, `vector<int>` in code\r\nand a < b"


@pytest.mark.parametrize("data, message", [
    ("{not json", "invalid JSON"),
    ('{"format": "other"}', "not a conversation file"),
    ('{"format": "h2o-chat/conversation", "version": 2, "messages": []}', "unknown conversation file version 2"),
    ('{"format": "h2o-chat/conversation", "version": 1, "messages": {}}', "messages = {}"),
    ('{"format": "h2o-chat/conversation", "version": 1, "messages": [3]}', r"messages\[0\] = 3"),
    ('{"format": "h2o-chat/conversation", "version": 1, "messages": [{"role": "system", "content": "x"}]}',
     "must be a user or assistant message"),
    ('{"format": "h2o-chat/conversation", "version": 1, "system_prompt": 5, "messages": []}', "system_prompt = 5"),
    (b"\xff\xfe", "invalid JSON"),
])
def test_malformed_conversation_is_refused(data, message):
    with pytest.raises(TranscriptError, match=message):
        read_transcript(data)


# ---- sessions with their cache ---------------------------------------------------------

def test_chat_resumes_with_identical_logits_and_evictions(smollm, tmp_path):
    model, tokenizer = smollm
    chat = new_chat(smollm, pin=True)  # continued below, so not the shared fixture
    path = save_session(chat, tmp_path / "chat.h2o-session.zip")
    resumed = load_session(path, model, tokenizer, small_cache(model), kind="chat")
    assert isinstance(resumed, ChatSession)
    assert resumed.messages == chat.messages and resumed.template_text == chat.template_text
    # The system prompt stays a fixed pin, the pinned message a pin of the user's.
    assert resumed.pins() == chat.pins() and [p.fixed for p in chat.pins()] == ["system prompt", None]
    assert_continues_identically(model, chat, resumed)


def test_resumed_chat_replies_like_the_uninterrupted_one(smollm, chat_file):
    model, tokenizer = smollm
    a, b = (load_session(chat_file, model, tokenizer, small_cache(model)) for _ in range(2))
    replies = ["".join(s.send("Three animals?", temperature=0, max_new_tokens=12)) for s in (a, b)]
    assert replies[0] == replies[1] and a.tokens == b.tokens


def test_story_resumes_with_identical_logits_and_evictions(smollm, tmp_path):
    model, tokenizer, rolling = *smollm, True  # the chat above does without rolling
    story = StorySession(model, tokenizer, cache=small_cache(model, rolling=rolling),
                         bible="Mira keeps the lighthouse.\n\n")
    "".join(story.send("The storm came at night.", temperature=0, max_new_tokens=24))
    path = save_session(story, tmp_path / "story.h2o-session.zip")
    resumed = load_session(path, model, tokenizer, small_cache(model, rolling=rolling), kind="story")
    assert isinstance(resumed, StorySession)
    assert resumed.bible_tokens == story.bible_tokens > 0 and resumed.text == story.text
    assert resumed.pins() == story.pins() and story.pins()[0].fixed == "story bible"
    assert_continues_identically(model, story, resumed)


def test_the_file_is_a_zip_of_json_and_safetensors(chat, chat_file):
    with zipfile.ZipFile(chat_file) as archive:
        assert sorted(archive.namelist()) == sorted([MANIFEST, TENSORS, CHECKSUM])
        manifest = json.loads(archive.read(MANIFEST))
        tensors = load_tensors(archive.read(TENSORS))
    assert manifest["version"] == VERSION and manifest["kind"] == "chat"
    assert manifest["cache"]["settings"] == {"policy": "h2o", **BUDGET, "rolling": False}
    assert manifest["cache"]["protected"] == [[0, 8]]
    assert manifest["model"] == model_identity(chat.model)
    assert tensors["tokens"].tolist() == chat.tokens and manifest["fed"] == chat.fed == len(chat.tokens) - 1
    assert manifest["messages"] == chat.messages
    held = chat.cache.stats().held
    assert tensors["layers.0.keys"].shape == (1, 3, held, 64) and tensors["layers.29.scores"].dtype == torch.float32


def rewritten(path, tmp_path, manifest=None, payload=None):
    """A copy of a session file with its manifest and/or payload replaced (a valid file,
    checksum included)."""
    old_manifest, old_payload = read_manifest(path)
    return write_session_file(tmp_path / "edited.h2o-session.zip",
                              json.dumps(manifest or old_manifest).encode(), payload or old_payload)


def refused(smollm, path, message, cache=None, kind=None):
    model, tokenizer = smollm
    cache = cache or small_cache(model)
    with pytest.raises(SnapshotError, match=message):
        load_session(path, model, tokenizer, cache, kind=kind)
    assert cache.seen == 0 and not cache.layers[0].is_initialized and not cache.spans.ranges  # left fresh


def test_truncated_and_corrupted_files_are_refused(smollm, chat_file, tmp_path):
    data = chat_file.read_bytes()
    truncated = tmp_path / "truncated.zip"
    truncated.write_bytes(data[: len(data) // 2])
    refused(smollm, truncated, "truncated")
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF  # inside the tensors: the zip's CRC catches it
    corrupted = tmp_path / "corrupted.zip"
    corrupted.write_bytes(bytes(flipped))
    refused(smollm, corrupted, "corrupted")
    with zipfile.ZipFile(chat_file) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    tampered = bytearray(members[TENSORS])
    tampered[-1] ^= 0x01  # valid zip, changed tensors: the checksum catches it
    edited = tmp_path / "tampered.h2o-session.zip"
    with zipfile.ZipFile(edited, "w") as archive:
        for name, data in (members | {TENSORS: bytes(tampered)}).items():
            archive.writestr(name, data)
    refused(smollm, edited, "do not match the sha256")
    plain = tmp_path / "notes.txt"
    plain.write_text("hello")
    refused(smollm, plain, "not a session file")


def test_unknown_version_and_bad_fields_are_refused(smollm, chat_file, tmp_path):
    manifest, _ = read_manifest(chat_file)
    refused(smollm, rewritten(chat_file, tmp_path, manifest | {"version": 99}),
            f"unknown session file version 99 \\(this app reads version {VERSION}\\)")
    refused(smollm, rewritten(chat_file, tmp_path, manifest | {"fed": 10_000}), "fed = 10000")
    refused(smollm, rewritten(chat_file, tmp_path, manifest | {"fed": 3}), r"layers\[0\].seen = \d+: must be an integer from 3 to 3")
    refused(smollm, chat_file, "this is a chat session file, not a story session", kind="story")
    refused(smollm, rewritten(chat_file, tmp_path, manifest | {"kind": ["chat"]}),
            r"not a session file: its kind is \['chat'\], not 'chat' or 'story'", kind="chat")
    layers = manifest["cache"]["layers"]
    bad_state = manifest["cache"] | {"layers": [layers[0] | {"held": 999}] + layers[1:]}
    refused(smollm, rewritten(chat_file, tmp_path, manifest | {"cache": bad_state}), r"cache.layers\[0\].held = 999: must be an integer from 0 to 44")


def test_pins_over_evicted_tokens_or_unpinned_slots_are_refused(smollm, chat, chat_file, tmp_path):
    """A pinned token is never evicted, so a file whose spans cover evicted tokens (or
    whose slots are marked pinned without a span) describes no cache the app could hold:
    resumed, its phantom pins widened the budget by their length (QA: 14 MB became 52 MB
    after one turn)."""
    manifest, payload = read_manifest(chat_file)
    evicted = [p for p in range(chat.fed) if p not in set(chat.cache.stats().layers[0].positions[0, 0].tolist())]
    assert manifest["cache"]["protected"] == [[0, 8]] and evicted[0] >= 8
    state = manifest["cache"] | {"protected": [[0, 8], [evicted[0], evicted[0] + 1]]}
    refused(smollm, rewritten(chat_file, tmp_path, manifest | {"cache": state}),
            rf"cache.protected covers token {evicted[0]}, which layer 0 does not hold as pinned in KV head 0: "
            r"a session holds every pinned token it has read \(evicted text cannot be pinned\)")
    tensors = load_tensors(payload)
    flags = tensors["layers.3.pinned"][0, 1]
    moved = int(flags.nonzero()[0]), int(flags.logical_not().nonzero()[0])  # as many marked
    flags[list(moved)] = torch.tensor([False, True])
    refused(smollm, rewritten(chat_file, tmp_path, payload=save_tensors(tensors)),
            r"cache.safetensors: layers.3.pinned marks a slot whose token no protected span covers")


def test_other_cache_settings_are_refused_naming_both_values(smollm, chat_file):
    model = smollm[0]
    refused(smollm, chat_file, "cache.heavy = 16 in the file, 32 in this cache: change the cache settings",
            cache=small_cache(model, heavy=32))
    refused(smollm, chat_file, "cache.policy = 'h2o' in the file, 'sink' in this cache",
            cache=small_cache(model, policy="sink"))
    refused(smollm, chat_file, "cache.rolling = false in the file, true in this cache",
            cache=small_cache(model, rolling=True))
    with pytest.raises(SettingsMismatch) as refusal:
        load_session(chat_file, model, smollm[1], small_cache(model, heavy=24, recent=8, rolling=True))
    assert str(refusal.value).startswith(
        "cache.heavy = 16 in the file, 24 in this cache; cache.recent = 16 in the file, 8 in this cache; "
        "cache.rolling = false in the file, true in this cache: change the cache settings")
    assert [d.name for d in refusal.value.differences] == ["heavy", "recent", "rolling"]


def test_settings_differences_lists_every_one_policy_first():
    h2o = {"policy": "h2o", "heavy": 24, "recent": 16, "sink": 4, "rolling": False}
    assert settings_differences(h2o, h2o) == []
    assert settings_differences(h2o, h2o | {"heavy": 16, "sink": 0, "rolling": True}) == [
        SettingDifference("heavy", 24, 16), SettingDifference("rolling", False, True),
        SettingDifference("sink", 4, 0)]
    # Settings only the current policy uses do not matter once the file's policy is taken.
    sink = {"policy": "sink", "sink": 4, "recent": 8, "rolling": False}
    assert settings_differences(sink, h2o) == [SettingDifference("policy", "sink", "h2o"),
                                               SettingDifference("recent", 8, 16)]
    assert settings_differences(h2o, sink) == [SettingDifference("policy", "h2o", "sink"),
                                               SettingDifference("heavy", 24, None),
                                               SettingDifference("recent", 16, 8)]
    # h2o's settings leave out score_norm at its default, "sum".
    assert settings_differences(h2o, h2o | {"score_norm": "mean"}) == [
        SettingDifference("score_norm", "sum", "mean")]
    assert describe_differences(settings_differences(h2o, sink), "in the file", "on the page") == (
        "cache.policy = 'h2o' in the file, 'sink' on the page; cache.heavy = 24 in the file, "
        "not used on the page; cache.recent = 16 in the file, 8 on the page")
    hostile = {f"x{i}": i for i in range(20)} | {"policy": "h2o" * 30}
    described = describe_differences(settings_differences(hostile, h2o), "in the file", "here")
    assert described.endswith("; and 13 more") and len(described) < 600
    assert settings_differences({"policy": [1]}, h2o)[0] == SettingDifference("policy", [1], "h2o")


def test_another_model_is_refused(smollm, chat_file, tiny_model):
    with pytest.raises(SnapshotError, match="saved with another model: 'SmolLM2-135M-Instruct"):
        load_session(chat_file, tiny_model, smollm[1], small_cache(tiny_model))


def test_the_fingerprint_tells_a_changed_weight_apart(tiny_model):
    before = model_identity(tiny_model)
    weight = tiny_model.model.layers[0].mlp.up_proj.weight
    kept = weight[0, 0].item()
    with torch.no_grad():
        weight[0, 0] += 1.0
    try:
        assert model_identity(tiny_model)["fingerprint"] != before["fingerprint"]
    finally:
        with torch.no_grad():
            weight[0, 0] = kept
    assert model_identity(tiny_model) == before


# ---- the cache's own state, on the tiny GQA model ------------------------------------

@pytest.mark.parametrize("rolling", [False, True])
def test_cache_state_roundtrip_continues_identically(tiny_model, rolling):
    torch.manual_seed(5)
    ids = torch.randint(0, 128, (2, 60))  # two rows evict on their own
    original = make_cache(tiny_model, "h2o", rolling=rolling, heavy=6, recent=5, sink=2)
    original.protect(0, 4)
    feed(tiny_model, original, ids, 16)
    tensors, info = original.state()
    resumed = make_cache(tiny_model, "h2o", rolling=rolling, heavy=6, recent=5, sink=2)
    resumed.load_state(load_tensors(save_tensors(tensors)), json.loads(json.dumps(info)))
    # The control: the same state without its accumulated scores evicts differently.
    forgetful = make_cache(tiny_model, "h2o", rolling=rolling, heavy=6, recent=5, sink=2)
    forgetful.load_state({k: t.zero_() if k.endswith("scores") else t for k, t in
                          load_tensors(save_tensors(tensors)).items()}, info)
    token, diverged = torch.tensor([[7], [9]]), False
    for _ in range(30):
        a, b = feed(tiny_model, original, token, 1), feed(tiny_model, resumed, token, 1)
        assert torch.equal(a, b)
        assert_same_cache(original, resumed)
        feed(tiny_model, forgetful, token, 1)
        diverged |= any(not torch.equal(x, y) for x, y in zip(kept_positions(original), kept_positions(forgetful)))
        token = a[:, -1:].argmax(-1)
    assert diverged and resumed.stats().held == 4 + 13 and resumed.seen == 90


def test_cache_state_of_other_settings_is_refused_and_changes_nothing(tiny_model):
    source = make_cache(tiny_model, "h2o", heavy=6, recent=5, sink=2)
    feed(tiny_model, source, torch.randint(0, 128, (1, 30)), 8)
    target = make_cache(tiny_model, "h2o", heavy=6, recent=6, sink=2)
    feed(tiny_model, target, torch.randint(0, 128, (1, 20)), 8)
    before = kept_positions(target)
    with pytest.raises(ValueError, match="cache.recent = 5 in the saved state, 6 in this cache"):
        target.load_state(*source.state())
    tensors, info = source.state()
    del tensors["layers.2.scores"]
    with pytest.raises(ValueError, match="layer 2: tensors"):
        make_cache(tiny_model, "h2o", heavy=6, recent=5, sink=2).load_state(tensors, info)
    assert target.seen == 20
    for x, y in zip(before, kept_positions(target)):
        assert torch.equal(x, y)


# ---- the views' Save / load panels, without a server ----------------------------------

@pytest.fixture(scope="module")
def views(smollm):
    import gradio as gr

    from h2o_chat.config import AppConfig, CacheConfig
    from h2o_chat.ui.chat_tab import ChatTab
    from h2o_chat.runtime import ModelProvider
    from h2o_chat.ui.settings import Settings
    from h2o_chat.ui.story_tab import StoryTab

    config = AppConfig(cache=CacheConfig(**BUDGET))
    provider = ModelProvider(lambda: smollm, "SmolLM2").start()
    provider.get()
    with gr.Blocks():
        settings = Settings(config)
        chat, story = ChatTab(provider, settings, config), StoryTab(provider, settings, config)
    return settings, chat, story


def inputs(settings, tab, state, **changed):
    """What a handler of ``tab`` receives: the settings as configured, then ``changed``
    (component attribute name -> value, e.g. heavy=32) and the view's state."""
    values = {c: c.value for c in settings.components} | {tab.map.live: True}
    values |= {picker: -1 for picker in tab.map.pickers} | {tab.state: state, tab.swap.signal: tab.swap.signal.value}
    return values | {getattr(settings, name): value for name, value in changed.items()}


def test_chat_panel_exports_imports_saves_and_resumes(views, tmp_path):
    settings, chat, _ = views
    files = chat.files
    # Start a chat the way the view does, through the import handler.
    conversation = Transcript("Be brief.", [{"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": "Hello!"}])
    upload = tmp_path / "conversation.json"
    upload.write_text(conversation.to_json())
    update = files.on_import(inputs(settings, chat, None) | {files.import_json: str(upload)})
    state = update[chat.state]
    assert update[chat.chatbot] == conversation.messages and update[chat.system_prompt] == "Be brief."
    assert state.session.fed == 0 and "Imported 2 messages" in update[files.status]
    with state.running():
        "".join(state.session.send("Name a colour.", temperature=0, max_new_tokens=24))

    values = inputs(settings, chat, state)
    exported = files.on_export_json(values)[files.download]
    assert read_transcript(open(exported, "rb").read()) == Transcript.of(state.session)
    assert open(files.on_export_markdown(values)[files.download]).read().startswith("# Conversation")

    saved = files.on_save(values)
    assert saved[files.download].endswith(".h2o-session.zip") and "Saved" in saved[files.status]
    resumed = files.on_resume(values | {files.resume: saved[files.download]})
    new = resumed[chat.state]
    assert new is not state and state.closed and not new.closed
    assert new.session.tokens == state.session.tokens and new.session.fed == state.session.fed
    assert resumed[chat.chatbot] == state.shown() and resumed[chat.system_prompt] == "Be brief."
    assert_same_cache(new.session.cache, state.session.cache)
    assert resumed[chat.gauge] and resumed[chat.map.tokens]  # gauge and map redrawn

    # The resumed chat goes on: rebuilding (regenerate/undo) uses the same settings.
    new.rebuild(new.shown()[:1])
    assert new.session.cache.settings() == state.session.cache.settings()


def test_downloads_older_than_the_files_kept_go_at_the_next_export(views):
    """A server up for weeks must not fill its disk (or a memory-backed /tmp) with every
    download it wrote (QA: exports and uploads were kept until the process exited)."""
    import os
    import time

    from h2o_chat.ui.chat_tab import ChatState
    from h2o_chat.ui.files_panel import FILES_KEPT_S
    from h2o_chat.ui.view_state import close_state

    settings, chat, _ = views
    files = chat.files
    state = ChatState(files.tab.provider.get(), settings.cache(inputs(settings, chat, None)), "Be brief.")
    try:
        with state.running():
            "".join(state.session.send("Hi", temperature=0, max_new_tokens=4))
        values = inputs(settings, chat, state)
        old, recent = (Path(files.on_export_json(values)[files.download]) for _ in range(2))
        long_ago = time.time() - FILES_KEPT_S - 60
        os.utime(old.parent, (long_ago, long_ago))
        new = Path(files.on_export_markdown(values)[files.download])
        assert not old.parent.exists() and recent.exists() and new.exists()
    finally:
        close_state(state)


def test_an_import_past_the_pages_limit_is_refused_unless_it_replaces_one(views, tmp_path, monkeypatch):
    """Importing a conversation opens one, as a first send does: past
    ``server.max_page_conversations`` it is refused, though the view's own (which it
    replaces) is not counted."""
    from h2o_chat.ui.view_state import close_state, server_load

    settings, chat, _ = views
    files = chat.files
    upload = tmp_path / "conversation.json"
    upload.write_text(Transcript("", [{"role": "user", "content": "Hi"}]).to_json())
    first = files.on_import(inputs(settings, chat, None) | {files.import_json: str(upload)})[chat.state]
    try:
        monkeypatch.setattr(chat.server, "max_page_conversations", server_load()[0])
        with pytest.warns(UserWarning):
            refused = files.on_import(inputs(settings, chat, None) | {files.import_json: str(upload)})
        assert refused == {files.status: f"**Not loaded:** The server holds {server_load()[0]} conversations "
                                         "open in pages, its limit (server.max_page_conversations): close a tab "
                                         "you no longer use, or wait until one idle for 30 minutes is freed."}
        again = files.on_import(inputs(settings, chat, first) | {files.import_json: str(upload)})[chat.state]
        assert first.closed and not again.closed
        close_state(again)
    finally:
        close_state(first)


def test_chat_panel_refusals_keep_the_session(views, tmp_path, monkeypatch):
    from h2o_chat.ui.chat_tab import ChatState
    from h2o_chat.ui.view_state import STILL_STREAMING

    settings, chat, story = views
    files = chat.files
    state = ChatState(files.tab.provider.get(), settings.cache(inputs(settings, chat, None)), "Be brief.")
    with state.running():
        "".join(state.session.send("Hi", temperature=0, max_new_tokens=4))
    values = inputs(settings, chat, state)
    path = files.on_save(values)[files.download]

    def refused_with(update, message):
        assert chat.state not in update and chat.chatbot not in update  # nothing replaced
        assert update[files.status].startswith("**Not loaded:**") and message in update[files.status]
        assert not state.closed

    with pytest.warns(UserWarning, match="cache.heavy"):
        refused_with(files.on_resume(inputs(settings, chat, state, heavy=32) | {files.resume: path}),
                     "cache.heavy = 16 in the file, 32 on the page")
    truncated = tmp_path / "truncated.zip"
    truncated.write_bytes(open(path, "rb").read()[:1000])
    with pytest.warns(UserWarning):
        refused_with(files.on_resume(values | {files.resume: str(truncated)}), "truncated")
    with pytest.warns(UserWarning):
        refused_with(files.on_resume(values | {files.resume: None}), "no file was uploaded")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "h2o-chat/conversation", "version": 7, "messages": []}')
    with pytest.warns(UserWarning):
        refused_with(files.on_import(values | {files.import_json: str(bad)}),
                     "unknown conversation file version 7")
    # Within the characters allowed, past the model's context: no send could go through.
    long = tmp_path / "long.json"
    long.write_text(Transcript("w " * 10_000, [{"role": "user", "content": "Hi"}]).to_json())
    with pytest.warns(UserWarning):
        refused_with(files.on_import(values | {files.import_json: str(long)}),
                     "conversation file: the conversation would reach 10,013 tokens with the imported messages "
                     "alone, past the model's context of 8,192")
    story_state = inputs(settings, story, None)
    with pytest.warns(UserWarning, match="chat session file, not a story session"):
        update = story.files.on_resume(story_state | {story.files.resume: path})
    assert story.state not in update
    monkeypatch.setattr(files.tab, "server", dataclasses.replace(files.tab.server, max_request_mb=1))
    big = tmp_path / "big.h2o-session.zip"
    big.write_bytes(Path(path).read_bytes() + bytes(2**20))
    with pytest.warns(UserWarning):
        refused_with(files.on_resume(values | {files.resume: str(big)}),
                     "over the upload limit of 1,048,576 bytes")
    with pytest.warns(UserWarning):  # a file of another type: the buttons take any
        refused_with(files.on_resume(values | {files.resume: str(bad)}), "bad.json is not a .zip file")
    # While a reply streams, saving and exporting wait for Stop, refused as a file is.
    with state.running():
        for save, outcome in ((files.on_save, "Not saved"), (files.on_export_json, "Not exported")):
            with pytest.warns(UserWarning, match="still streaming"):
                assert save(values) == {files.status: f"**{outcome}:** {STILL_STREAMING}"}


def test_a_file_of_other_cache_settings_is_resumed_with_them_on_request(views):
    from h2o_chat.ui.chat_tab import ChatState
    from h2o_chat.ui.refusals import Refusal

    settings, chat, _ = views
    files = chat.files
    state = ChatState(files.tab.provider.get(), settings.cache(inputs(settings, chat, None)), "Be brief.")
    with state.running():
        "".join(state.session.send("Hi", temperature=0, max_new_tokens=4))
    path = files.on_save(inputs(settings, chat, state))[files.download]

    page = inputs(settings, chat, None, heavy=32, recent=8, rolling=True)
    with pytest.warns(UserWarning, match="cache.heavy"):
        refused = files.on_resume(page | {files.resume: path})
    assert chat.state not in refused
    assert ("cache.heavy = 16 in the file, 32 on the page; cache.recent = 16 in the file, 8 on the page; "
            "cache.rolling = false in the file, true on the page") in refused[files.status]
    assert refused[files.adopt]["visible"] is True

    adopted = files.on_adopt(page | {files.mismatched: refused[files.mismatched]})
    new = adopted[chat.state]
    assert new.session.tokens == state.session.tokens and new.cache.heavy == 16
    assert_same_cache(new.session.cache, state.session.cache)
    assert {settings.heavy: 16, settings.recent: 16, settings.rolling: False}.items() <= adopted.items()
    assert adopted[files.status].startswith("Resumed with the file's cache settings (heavy 16, recent 16, rolling False)")
    assert adopted[files.adopt]["visible"] is False and adopted[files.mismatched] is None
    with new.running():
        assert "".join(new.session.send("Bye", temperature=0, max_new_tokens=4))
    # A setting without a control is taken only where the config file already has it.
    settings.check_adoptable([SettingDifference("score_norm", "sum", "mean")])
    with pytest.raises(Refusal, match="cache.score_norm = 'mean' in the file, 'sum' in the config file: "
                                      "the page cannot change it"):
        settings.check_adoptable([SettingDifference("score_norm", "mean", "sum")])


def test_a_story_under_the_turns_policy_names_and_adopts_the_controls_settings(views):
    """A story runs the page's turns policy as h2o, its slots split evenly. A story saved
    under h2o 20/12, refused on a turns 30/8 page, was listed against the 19/19 that
    would run (numbers no control showed), and adopting set 20/12 under turns, which ran
    as 16/16: refused again."""
    from h2o_chat.ui.story_tab import StoryState

    settings, _, story = views
    files = story.files
    state = StoryState(files.tab.provider.get(), settings.cache(inputs(settings, story, None, policy="h2o", heavy=20, recent=12)),
                       "Mira keeps the lighthouse.")
    "".join(state.session.send("The storm came.", temperature=0, max_new_tokens=8))
    path = files.on_save(inputs(settings, story, state))[files.download]
    page = inputs(settings, story, None, policy="turns", heavy=30, recent=8)
    with pytest.warns(UserWarning, match="cache.policy"):
        refused = files.on_resume(page | {files.resume: path})
    assert ("cache.policy = 'h2o' in the file, 'turns' on the page; cache.heavy = 20 in the file, 30 on the page; "
            "cache.recent = 12 in the file, 8 on the page") in refused[files.status]
    adopted = files.on_adopt(page | {files.mismatched: refused[files.mismatched]})
    assert adopted[files.status].startswith("Resumed with the file's cache settings (policy h2o, heavy 20, recent 12")
    assert_same_cache(adopted[story.state].session.cache, state.session.cache)


# A page of K8/V4 and 1 MB (88 tokens of the embedded model; turns: sink 4, heavy 79, recent 5).
BYTE_BUDGET_PAGE = dict(budget_mb="1", key_bits="8", value_bits="4")
BYTE_BUDGET_DIFFERENCES = ("cache.budget_bytes = 1000000 in the file, not used on the page; "
                           "cache.heavy = 79 in the file, 16 on the page; cache.key_bits = 8 in the file, not used "
                           "on the page; cache.recent = 5 in the file, 16 on the page; cache.value_bits = 4 in the "
                           "file, not used on the page")


def saved_with_a_byte_budget(views):
    """A chat of the panel at 1 MB and K8/V4, past its budget, and the file it saved."""
    from h2o_chat.ui.chat_tab import ChatState

    settings, chat, _ = views
    files = chat.files
    state = ChatState(files.tab.provider.get(), settings.cache(inputs(settings, chat, None, **BYTE_BUDGET_PAGE)),
                      "Be brief.")
    with state.running():
        "".join(state.session.send("Tell me about the sea and its ships, every one of them. " * 6,
                                   temperature=0, max_new_tokens=12))
    assert state.session.stats().cache.budget_reached
    return state.session, files.on_save(inputs(settings, chat, state, **BYTE_BUDGET_PAGE))[files.download]


def test_a_file_saved_with_a_byte_budget_resumes_with_its_settings_and_identical_logits(views, smollm):
    settings, chat, _ = views
    files = chat.files
    original, path = saved_with_a_byte_budget(views)
    page = inputs(settings, chat, None)  # the config's slots, the model's precision
    with pytest.warns(UserWarning, match="cache.budget_bytes"):
        refused = files.on_resume(page | {files.resume: path})
    assert refused[files.status] == (f"**Not loaded:** this session was saved with other cache settings: "
                                     f"{BYTE_BUDGET_DIFFERENCES}. Set the cache settings to the file's, or use the "
                                     "file's settings with the button below.")
    assert refused[files.adopt]["visible"] is True

    adopted = files.on_adopt(page | {files.mismatched: refused[files.mismatched]})
    assert adopted[files.status].startswith("Resumed with the file's cache settings (budget_mb 1, heavy 79, "
                                            "key_bits 8, recent 5, value_bits 4): ")
    assert {settings.budget_mb: "1", settings.key_bits: "8", settings.value_bits: "4"}.items() <= adopted.items()
    assert_continues_identically(smollm[0], original, adopted[chat.state].session)


@pytest.mark.parametrize("budget, why", [
    (10**30, "cache.budget_bytes = <a 31-digit number>: must be an integer number of bytes from 1 to "
             "1,000,000,000,000 (1,000,000 MB), or null"),
    ("5", "cache.budget_bytes = '5': must be an integer number of bytes from 1 to 1,000,000,000,000 "
          "(1,000,000 MB), or null"),
    (2.5, "cache.budget_bytes = 2.5: must be an integer number of bytes from 1 to 1,000,000,000,000 "
          "(1,000,000 MB), or null"),
    (10**9, "cache.budget_mb = 1000.0: holds 88,183 tokens at 11,340 bytes a token; must hold from 5 (the sink "
            "plus one) to 8,192 (the model's context, max_position_embeddings), i.e. from 0.0567 MB to "
            "92.9086 MB"),
])
def test_a_files_byte_budget_the_page_cannot_take_is_refused_on_upload_naming_it(views, tmp_path, budget, why):
    from .test_hostile import edited

    settings, chat, _ = views
    files = chat.files
    _, path = saved_with_a_byte_budget(views)

    def lie(manifest):
        manifest["cache"]["settings"]["budget_bytes"] = budget

    crafted = edited(Path(path), tmp_path, "budget", manifest=lie)
    with pytest.warns(UserWarning, match="cache.budget"):
        refused = files.on_resume(inputs(settings, chat, None) | {files.resume: str(crafted)})
    assert chat.state not in refused and refused[files.adopt]["visible"] is False
    assert refused[files.status].startswith("**Not loaded:** this session was saved with other cache settings: "
                                            "cache.budget_bytes = ")
    from h2o_chat.ui.refusals import markdown_literal

    # Shown as written: unescaped, "<a 31-digit number>" was an HTML link in the page.
    assert refused[files.status].endswith(markdown_literal(f"; the file's cache settings: {why}"))


def test_story_panel_saves_and_resumes(views):
    from h2o_chat.ui.story_tab import StoryState

    settings, _, story = views
    files = story.files
    state = StoryState(files.tab.provider.get(), settings.cache(inputs(settings, story, None)),
                       "Mira keeps the lighthouse.")
    "".join(state.session.send("The storm came.", temperature=0, max_new_tokens=30))
    values = inputs(settings, story, state)
    path = files.on_save(values)[files.download]
    update = files.on_resume(values | {files.resume: path})
    new = update[story.state]
    assert update[story.bible] == "Mira keeps the lighthouse." and update[story.story] == state.session.text
    assert new.continues(update[story.bible], update[story.story] + " More.")  # no re-read needed
    assert new.session.tokens == state.session.tokens and new.session.bible_tokens == state.session.bible_tokens
    assert_same_cache(new.session.cache, state.session.cache)


def test_the_pages_refuse_hostile_input_with_the_limit(views, tmp_path):
    from h2o_chat.ui.refusals import Refusal

    settings, chat, story = views
    values = inputs(settings, chat, None) | {chat.text: "Hi", chat.system_prompt: "x" * 25_000,
                                             chat.pin_message: False}
    # Refusals (one message, the page left as it was), not failures of the app.
    with pytest.raises(Refusal, match=r"the system prompt is 25,000 characters long; the limit is 20,000"):
        next(chat.on_send(values))
    values = inputs(settings, story, None) | {story.bible: "b" * 25_000, story.story: "Once", story.tokens: 8}
    with pytest.raises(Refusal, match=r"the story bible is 25,000 characters long; the limit is 20,000"):
        next(story.on_continue(values))
    upload = tmp_path / "many.json"
    upload.write_text(Transcript(None, [{"role": "user", "content": "x"}] * 10_001).to_json())
    with pytest.warns(UserWarning, match="messages holds 10,001 messages; the limit is 10,000"):
        update = chat.files.on_import(inputs(settings, chat, None) | {chat.files.import_json: str(upload)})
    assert chat.state not in update and update[chat.files.status].startswith("**Not loaded:**")


def test_a_turns_chat_resumes_with_its_turns_and_identical_logits(smollm, tmp_path):
    """The turns policy's marks and open turn travel in the file; crafted ones are refused
    by the gate, naming the field, and leave the cache fresh."""
    model, tokenizer = smollm
    chat = ChatSession(model, tokenizer, cache=small_cache(model, "turns"), system_prompt="Be brief.")
    for text in ("Name three fruits.", "And three colours?", "One more fruit?"):
        "".join(chat.send(text, temperature=0, max_new_tokens=12))
    assert len(chat.cache.turns.starts) == 3 and chat.cache.turns.opened == chat.cache.turns.starts[-1]
    path = save_session(chat, tmp_path / "turns.h2o-session.zip")
    resumed = load_session(path, model, tokenizer, small_cache(model, "turns"), kind="chat")
    assert resumed.cache.turns.starts == chat.cache.turns.starts
    assert resumed.cache.turns.opened == chat.cache.turns.opened
    assert_continues_identically(model, chat, resumed)

    manifest, _ = read_manifest(path)
    state = manifest["cache"]
    starts = state["turns"]["starts"]
    for turns, message in [
        (None, r"cache.turns must be an object with starts and opened"),
        ({"starts": [starts[1], starts[0]], "opened": 0}, r"cache.turns.starts\[1\] = \d+: must be an integer from"),
        ({"starts": starts + [10**9], "opened": 0}, r"cache.turns.starts\[3\] = 1000000000"),
        # A start on the last token leaves no room for another: say so, not "from N to N - 1".
        ({"starts": starts + [len(chat.tokens) - 1, 1], "opened": 0},
         r"cache.turns.starts\[4\] = 1: no value fits here: it would have to be at least (\d+) and at most "
         r"(?!\1)\d+ \(after the one before, within the tokens\)"),
        ({"starts": starts, "opened": starts[0] + 1}, r"cache.turns.opened = \d+: must be 0 or one of the turn starts"),
        ({"starts": list(range(10**5)), "opened": 0}, r"cache.turns.starts must be a list of at most"),
    ]:
        crafted = {key: value for key, value in state.items() if key != "turns"}
        if turns is not None:
            crafted["turns"] = turns
        refused(smollm, rewritten(path, tmp_path, manifest | {"cache": crafted}), message,
                cache=small_cache(model, "turns"))
