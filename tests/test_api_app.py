"""``app.py`` serves the page and the API on one port: the page keeps its login and the
API asks for its key."""

from __future__ import annotations

import httpx
from openai import OpenAI

from .browser_support import running_app


def test_the_page_and_the_api_share_one_port_each_with_its_own_login(monkeypatch, tmp_path):
    monkeypatch.setenv("H2O_CHAT_USERNAME", "ann")
    monkeypatch.setenv("H2O_CHAT_PASSWORD", "s3cret")
    monkeypatch.setenv("H2O_CHAT_API_KEY", "k-123")
    config = tmp_path / "config.yaml"
    config.write_text("server:\n  max_request_mb: 1\n")
    with running_app("--config", str(config)) as url:
        assert url.startswith("http://127.0.0.1:")
        page = httpx.get(url)
        assert page.status_code == 200 and "gradio" in page.text.lower()
        # The page's own API wants the login; the OpenAI API wants the key.
        assert httpx.get(url + "gradio_api/info").status_code == 401
        login = httpx.post(url + "login", data={"username": "ann", "password": "s3cret"})
        assert login.status_code == 200
        assert httpx.get(url + "v1/models").status_code == 401
        client = OpenAI(base_url=url + "v1", api_key="k-123", max_retries=0, timeout=300)
        reply = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, temperature=0)
        assert reply.choices[0].message.content and reply.usage.completion_tokens <= 4
        assert httpx.get(url + "health").json()["status"] == "ok"
        # The page's request-size limit still holds in front of the mounted UI.
        too_big = httpx.post(url + "gradio_api/upload", content=b"x" * (2**20 + 1))
        assert too_big.status_code == 413 and "server.max_request_mb" in too_big.text
