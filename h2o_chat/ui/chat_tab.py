"""The chat view: a multi-turn dialogue streamed on one H2O cache per browser session."""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence

import gradio as gr

from h2o_chat.config import AppConfig, CacheConfig
from h2o_chat.inputs import InputLimits, is_blank
from h2o_chat.runtime import LoadedModel, ModelProvider
from h2o_chat.sessions import ChatSession, chat_session

from .chat_box import ChatBox, typed_text
from .controls import SendStopSwap, send_button, stop_button
from .files_panel import ChatFiles
from .gauges import GAUGE_CSS, empty_gauge
from .map_panel import MapPanel, gauge_and_map
from .pin_panel import PinPanel, carry_pins, pin_message_checkbox, same_text
from .refusals import Refusal, refusing, warn
from .reply_marker import marked
from .reply_settings import NOTHING_YET, ran_with, ran_with_line
from .settings import Settings, budget, check_fits, new_cache
from .streaming import TurnEnd, in_slot, message_back, reply_failed, stream_turn
from .view_state import (
    ViewState, admit, browser_state, close_state, generating, not_streaming, unchanged, wait_for_model,
)

GAUGE_LABEL = "Token counter"
LOADING_REPLY = "(waiting for the model to load…)"


class ChatState(ViewState):
    """One browser's chat: its session, and how to rebuild it from an edited history."""

    def __init__(self, loaded: LoadedModel, cache: CacheConfig, system_prompt: str,
                 limits: InputLimits | None = None) -> None:
        super().__init__(loaded)
        self.cache, self.system_prompt = cache, system_prompt
        self.limits = limits
        self.session = self._new_session([])

    def _new_session(self, history: list[dict[str, str]]) -> ChatSession:
        model, tokenizer = self.loaded.model, self.loaded.tokenizer
        return chat_session(model, tokenizer, self.cache, system_prompt=self.system_prompt,
                            history=history, limits=self.limits, cache=new_cache(model, self.cache),
                            memory=self.loaded.memory)

    def sessions(self) -> list[ChatSession]:
        return [self.session]

    def shown(self) -> list[dict[str, str]]:
        return shown_messages(self.session)

    def rebuild(self, history: list[dict[str, str]], then: str | None = None,
                resent_pin: str | None = None) -> list[str]:
        """Go back in time: a fresh cache on ``history``, fed on the next send (an
        evicting cache cannot un-see the turns after it). ``then``: the message about to
        be sent on it (an edit, a regenerate), checked first: where it would be refused
        (ValueError), or ``history`` is, nothing changes. ``resent_pin``: the text of a
        pin that message takes over; returned: the pins' texts that message is to pin
        (see ``carry_pins``)."""
        session = self._new_session(history)
        if then is not None:
            session.check_message(then)
        old, self.session = self.session, session
        in_message = carry_pins(old, session, resent_pin, then)
        self.forget_snapshot()
        return in_message

    def pinned(self, text: str) -> bool:
        """Whether a pin of yours holds exactly ``text`` (as "pin this message" does)."""
        return any(not pin.fixed and same_text(pin.text, text) for pin in self.session.pins())


def shown_messages(session: ChatSession) -> list[dict[str, str]]:
    """The conversation as a chatbot shows it: copies, without the system message."""
    return [dict(m) for m in session.messages if m["role"] != "system"]


def echo_while_loading(text: str) -> list[dict[str, str]]:
    """A chat box's messages while the model loads: the message sent, shown at once."""
    return [{"role": "user", "content": text}, {"role": "assistant", "content": LOADING_REPLY}]


def _last_user_index(messages: list[dict[str, str]]) -> int | None:
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    return users[-1] if users else None


class ChatTab:
    """Built inside the chat tab's context; wires its events."""

    def __init__(self, provider: ModelProvider, settings: Settings, config: AppConfig) -> None:
        self.provider, self.settings = provider, settings
        self.server = config.server
        self.state = browser_state(config.server)
        with gr.Row():
            with gr.Column(scale=3):
                # Sized to the window, so the input and its buttons stay in view at 768 px.
                # No label or copy-all icon (the tab names the view): they floated over
                # the top message.
                self.chatbot = ChatBox(label="Chat", show_label=False, buttons=["copy"],
                                       height="calc(100vh - 410px)", min_height=240,
                                       editable="user", elem_id="chatbot",
                                       placeholder="Ask anything. Replies stream token by token.")
                self.ran_with = ran_with_line("chat")
                with gr.Row(equal_height=True, elem_id="chat-send-row"):
                    # Its label is only read out (screen readers said "Textbox"). Where the
                    # window has room, small_screens adds the keys that send and stop to the
                    # placeholder.
                    self.text = gr.Textbox(placeholder="Type a message",
                                           label="Message", show_label=False, scale=5,
                                           elem_id="chat-input")
                    self.pin_message = pin_message_checkbox("chat")
                    self.send = send_button("Send", "chat-send", scale=0, min_width=100)
                    self.stop = stop_button("chat")
                with gr.Row():
                    self.regenerate = gr.Button("Regenerate", elem_id="chat-regenerate")
                    self.undo = gr.Button("Undo", elem_id="chat-undo")
                    self.new = gr.Button("New chat", elem_id="chat-new")
            with gr.Column(scale=2):
                self.gauge = gr.HTML(self.empty_gauge(config.cache),
                                     css_template=GAUGE_CSS, elem_id="chat-gauge")
                self.system_prompt = gr.Textbox(
                    config.generation.system_prompt, lines=3, elem_id="system-prompt",
                    label="System prompt (applies to the next new chat; kept out of eviction)")
                self.files = ChatFiles()
                self.pins = PinPanel("chat")
        self.map = MapPanel("chat")
        self._wire()

    def _wire(self) -> None:
        self.swap = SendStopSwap(self.send, self.stop, self.state, self.text)
        turn_inputs = {self.state, self.swap.signal, self.text, self.system_prompt, self.map.live,
                       self.pin_message, *self.settings.components, *self.map.pickers}
        outputs = [self.state, self.chatbot, self.ran_with, self.text, self.gauge, *self.map.outputs,
                   self.pin_message, *self.pins.outputs]
        # "multiple": a second Enter while a reply streams is refused with a message,
        # not dropped silently.
        sends = [self.text.submit, self.send.click]
        regenerates = [self.regenerate.click, self.chatbot.retry]
        self.swap.on([*sends, *regenerates, self.chatbot.edit, self.chatbot.option_select])
        turns = [
            gr.on(sends, refusing(self.on_send, self.chatbot), turn_inputs, outputs,
                  trigger_mode="multiple", **generating(self.server)),
            gr.on(regenerates, refusing(self.on_regenerate, self.chatbot), turn_inputs, outputs,
                  **generating(self.server)),
            self.chatbot.edit(refusing(self.on_edit, self.chatbot), turn_inputs, outputs,
                              **generating(self.server)),
            # The only option a message has is the Continue chip of a reply cut short.
            self.chatbot.option_select(refusing(self.on_continue, self.chatbot), turn_inputs,
                                       outputs, **generating(self.server)),
        ]
        self.swap.until(turns)
        gr.on([self.undo.click, self.chatbot.undo], refusing(self.on_undo, self.chatbot),
              turn_inputs, outputs)
        gr.on([self.new.click, self.chatbot.clear], refusing(self.on_new, self.chatbot),
              {self.state, *self.settings.components}, outputs)
        self.settings.follow(self.state, [self.gauge], self.idle)
        self.map.wire(self.state)
        self.files.wire(self, ChatState)
        self.pins.wire(self.state, lambda values, state: self.views(values, state, True),
                       {self.map.live, *self.map.pickers}, [self.gauge, *self.map.outputs])

    def idle(self, cache: CacheConfig) -> dict:
        """The gauge before a chat starts, for settings New chat takes (a ``Refusal`` for
        others: a budget past the model's context)."""
        check_fits(self.provider.loaded_model, cache)
        return {self.gauge: self.empty_gauge(cache)}

    def empty_gauge(self, cache: CacheConfig) -> str:
        """The gauge before a chat starts: the budget its cache will get."""
        return empty_gauge(GAUGE_LABEL, budget(cache, self.provider.loaded_model), cache)

    def on_send(self, values: dict) -> Iterator[dict]:
        text = values[self.text]
        if is_blank(text):
            raise Refusal("Type a message first.")
        state = values[self.state]
        if state is None:
            admit(self.server)
            if not self.provider.ready:
                yield {self.chatbot: echo_while_loading(text)}
            try:
                state = ChatState(wait_for_model(self.provider), self.settings.cache(values),
                                  values[self.system_prompt], InputLimits.of(self.server))
            except ValueError as err:  # the system prompt is refused (too long, say)
                raise Refusal(str(err)) from None
        with state.running():
            yield from self._turn(values, state, text)

    def on_regenerate(self, values: dict) -> Iterator[dict]:
        state = values[self.state]
        index = _last_user_index(state.shown()) if state else None
        if index is None:
            raise Refusal("Nothing to regenerate yet.")
        with state.running():
            yield from self._again(values, state, index, state.shown()[index]["content"])

    def on_edit(self, values: dict, edit: gr.EditData) -> Iterator[dict]:
        state = values[self.state]
        if state is None:
            raise Refusal("Nothing to edit yet.")
        with state.running():
            shown, index, text = state.shown(), edit.index, typed_text(edit.value)
            if isinstance(index, (tuple, list)):
                index = index[0]
            if not 0 <= index < len(shown):
                yield self._edit_refused(state, "That message is no longer in the conversation.")
            elif shown[index]["role"] == "user":
                yield from self._again(values, state, index, text)
            else:
                try:
                    state.rebuild(shown[:index] + [{"role": "assistant", "content": text}])
                except ValueError as err:
                    yield self._edit_refused(state, str(err))
                    return
                yield {self.chatbot: state.shown()} | self.views(values, state, True)

    def _again(self, values: dict, state: ChatState, index: int, text: str) -> Iterator[dict]:
        """``text`` sent in place of user message ``index`` and all after it (regenerate,
        edit). A pinned message stays pinned; the message box keeps what it holds. Refused,
        the conversation is as it was, and so is the page (the chatbot showed the edit)."""
        replaced = state.shown()[index]["content"]
        pinned = state.pinned(replaced)
        try:
            in_message = state.rebuild(state.shown()[:index], then=text, resent_pin=replaced if pinned else None)
        except ValueError as err:
            yield self._edit_refused(state, str(err))
            return
        yield from self._turn(values, state, text, pin=pinned, from_box=False, pin_parts=in_message)

    def _edit_refused(self, state: ChatState, message: str) -> dict:
        warn(message)
        return {self.chatbot: state.shown()}

    def on_continue(self, values: dict) -> Iterator[dict]:
        state = values[self.state]
        if state is None:
            raise Refusal("Nothing to continue yet.")
        with state.running():
            sampling = self.settings.sampling(values)
            try:
                stream = state.session.continue_reply(stop=self.swap.stop_event(values), **sampling)
            except ValueError as err:
                raise Refusal(str(err)) from None
            shown = state.shown()  # the reply so far last, without its chip
            yield {self.state: state, self.chatbot: shown,
                   self.ran_with: ran_with(sampling, state.cache)}
            # The chunks extend the reply's text, which ends at its last whole character.
            failure = yield from self._stream(values, state, stream, sampling, shown[:-1], shown[-1]["content"])
            if failure is not None and not state.closed:
                reply_failed(failure)

    def on_undo(self, values: dict) -> dict:
        state = values[self.state]
        index = _last_user_index(state.shown()) if state else None
        if index is None:
            return unchanged(self.chatbot)
        with state.running():
            shown = state.shown()
            state.rebuild(shown[:index])
            return ({self.chatbot: shown[:index], self.text: shown[index]["content"]}
                    | self.views(values, state, True))

    def on_new(self, values: dict) -> dict:
        # The running turn's updates would go on drawing the old conversation over the new.
        not_streaming(values[self.state])
        # Refused before anything closes, as Send refuses it.
        idle = self.idle(self.settings.cache(values))
        close_state(values[self.state])
        return idle | {self.state: None, self.chatbot: [], self.ran_with: NOTHING_YET,
                       **{output: "" for output in self.map.outputs}, **self.pins.cleared()}

    def _turn(self, values: dict, state: ChatState, text: str, pin: bool | None = None,
              from_box: bool = True, pin_parts: Sequence[str] = ()) -> Iterator[dict]:
        """Send ``text``, pinned where ``pin`` (default: the box's "pin this message"),
        its ``pin_parts`` pinned; ``from_box``: the text came from the message box, which
        is emptied."""
        sampling = self.settings.sampling(values)
        try:
            stream = state.session.send(text, pin=bool(values[self.pin_message]) if pin is None else pin,
                                        stop=self.swap.stop_event(values), pin_parts=pin_parts, **sampling)
        except ValueError as err:
            raise Refusal(str(err)) from None
        shown = state.shown() + [{"role": "user", "content": text}]
        box = {self.text: "", self.pin_message: False} if from_box else {}
        yield {self.state: state, self.chatbot: shown, self.ran_with: ran_with(sampling, state.cache)} | box
        failure = yield from self._stream(values, state, stream, sampling, shown)
        if state.closed:
            return
        if len(state.shown()) < len(shown):
            # Stopped or failed before its first token (refused as it began, say): the
            # session took the turn back, so the message goes back to its box.
            yield message_back(self.text, text, failure) | {self.pin_message: values[self.pin_message]}
        elif failure is not None:
            reply_failed(failure)

    def _stream(self, values: dict, state: ChatState, stream: Iterator[str], sampling: dict,
                shown: list[dict[str, str]], so_far: str = "") -> Generator[dict, None, TurnEnd]:
        """Stream a reply under ``shown``, its text ``so_far`` plus the chunks; at the end
        the conversation as the session holds it, with the chip of a reply cut short.
        Returns the failure that ended it, if any."""
        limit = sampling["max_new_tokens"]

        def show(more: str) -> dict:
            return {self.chatbot: shown + [{"role": "assistant", "content": so_far + more}]}

        return (yield from in_slot(self.provider.admission, self.swap.stop_event(values), stream_turn(
            stream,
            show=show,
            views=lambda final: self.views(values, state, final),
            final=lambda: {self.chatbot: marked(state.shown(), state.session, limit)},
            closed=lambda: state.closed,
        ), waiting=lambda note: show(f"*{note}*")))

    def views(self, values: dict, state: ChatState, final: bool) -> dict:
        """Gauge, map (if live or ``final``) and, when ``final``, the pin list."""
        pins = self.pins.render(state.session) if final else {}
        return gauge_and_map(self.gauge, GAUGE_LABEL, self.map, state, values, final) | pins
