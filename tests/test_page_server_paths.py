"""A page client can hand the page's file inputs only files it uploaded: a path on the
server it names itself (a conversation written elsewhere, /dev/zero) is refused before
anything is read. Sent for real with ``httpx`` to the served app's Gradio queue, as a
script would, since a browser never sends such a path."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest

REFUSED = "to the gradio cache dir because it was not uploaded by a user."


def handed_path(url: str, handler: str, path: str) -> dict:
    """The page's ``handler`` run with ``path`` in place of its uploaded file; the
    queue's last message for it."""
    with httpx.Client(base_url=url, timeout=60) as client:
        config = client.get("/config").json()
        props = {c["id"]: c.get("props", {}) for c in config["components"]}
        event = next(d for d in config["dependencies"] if d.get("api_name") == handler)
        data = [{"path": path, "orig_name": Path(path).name, "meta": {"_type": "gradio.FileData"}}
                if props[i].get("elem_id", "").endswith(("resume-session", "import-json"))
                else props[i].get("value") for i in event["inputs"]]
        session = uuid.uuid4().hex[:11]
        client.post("/gradio_api/queue/join", json={
            "data": data, "fn_index": event["id"], "session_hash": session,
            "trigger_id": event["targets"][0][0]}).raise_for_status()
        with client.stream("GET", f"/gradio_api/queue/data?session_hash={session}") as stream:
            for line in stream.iter_lines():
                message = json.loads(line.removeprefix("data:")) if line.startswith("data:") else {}
                if message.get("msg") == "process_completed":
                    return message
    raise AssertionError(f"{handler} never completed")


def test_a_conversation_elsewhere_on_the_server_is_not_imported(app_url, tmp_path):
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"format": "h2o-chat/conversation", "version": 1, "system_prompt": "",
                                     "messages": [{"role": "user", "content": "NOT FOR THE PAGE"}]}))
    done = handed_path(app_url, "on_import", str(elsewhere))
    assert done["success"] is False
    assert done["output"]["error"] == f"Cannot move {elsewhere} {REFUSED}"
    assert "NOT FOR THE PAGE" not in json.dumps(done)


@pytest.mark.parametrize("path", ["/dev/zero", "/etc/hostname"])
def test_a_server_path_handed_to_resume_is_refused_unread(app_url, path):
    done = handed_path(app_url, "on_resume", path)
    assert done["success"] is False and done["output"]["error"] == f"Cannot move {path} {REFUSED}"
