"""A page loaded again says so: what it held is gone.

The server keeps nothing for a page that loads again: a new page is a new Gradio session,
with an empty conversation and the default settings. Gradio's page (6.31) also reloads
itself when its event stream breaks (on a machine far past its cores): it shows
"Connection Lost", polls the server and reloads once it answers. Either way the user must
not take the defaults for the settings typed before, so the page says plainly that the
conversation and the typed settings were reset.
"""

from __future__ import annotations

import json

import gradio as gr

RESET_NOTE = ("**This page was loaded again, so it starts afresh:** the conversation it "
              "showed and any settings typed into it were reset to the defaults shown "
              "below (the server keeps nothing for a page that reloads).")

# Set by the server on a successful login (``api.page_guards``): Gradio's login form
# reloads the page once logged in, a reload that reset nothing the user had.
FRESH_LOGIN_COOKIE = "h2o-chat-fresh-login"

# Runs in the page as it loads (no server round trip): the note shows only when the
# browser reports this load as a reload, and not the one that follows a login (whose
# cookie it takes away). ``data-reload-checked`` on the body says the check ran.
SHOW_IF_RELOADED = f"""() => {{
  const entry = performance.getEntriesByType("navigation")[0];
  const login = document.cookie.split("; ").includes("{FRESH_LOGIN_COOKIE}=1");
  if (login) document.cookie = "{FRESH_LOGIN_COOKIE}=; Max-Age=0; Path=/; SameSite=Strict";
  document.body.dataset.reloadChecked = "true";
  return entry && entry.type === "reload" && !login
    ? {{__type__: "update", visible: true, value: {json.dumps(RESET_NOTE)}}}
    : {{__type__: "update"}};
}}"""


def say_when_reloaded(demo: gr.Blocks) -> None:
    """A note at the top of the page, ``#page-reset``, shown when the page was reloaded."""
    note = gr.Markdown(visible=False, elem_id="page-reset")
    demo.load(None, None, note, js=SHOW_IF_RELOADED, queue=False, show_progress="hidden")
