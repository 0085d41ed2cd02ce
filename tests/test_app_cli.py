"""app.py's flags become config overrides; only the flags given override the file. A
server others can reach with the page or the API unguarded says so when it starts."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest

import app
from h2o_chat.api.server import exposure_warning
from h2o_chat.config import ConfigError, ServerConfig, load_config

from .browser_support import running_app

PAGE_OPEN = ("the page (no login: set server.username and server.password, "
             "or H2O_CHAT_USERNAME and H2O_CHAT_PASSWORD)")
API_OPEN = "the API (no key: set server.api_key or H2O_CHAT_API_KEY)"


def test_no_flags_keep_the_config():
    args = app.parse_args([])
    assert app.overrides(args) == {}
    config = load_config(args.config, app.overrides(args))
    assert (config.server.host, config.server.port, config.server.share) == ("127.0.0.1", 7860, False)


def test_flags_override_server_and_cache():
    args = app.parse_args(["--host", "0.0.0.0", "--port", "9000", "--share",
                           "--policy", "sink", "--recent", "64", "--sink", "8"])
    assert app.overrides(args) == {
        "server": {"host": "0.0.0.0", "port": 9000, "share": True},
        "cache": {"policy": "sink", "recent": 64, "sink": 8},
    }
    config = load_config(None, app.overrides(args))
    assert config.server.share and config.cache.recent == 64 and config.cache.heavy == 240


def test_storage_and_byte_budget_flags_reach_the_cache_settings():
    args = app.parse_args(["--key-bits", "8", "--value-bits", "4", "--budget-mb", "2.5"])
    assert app.overrides(args) == {"cache": {"key_bits": 8, "value_bits": 4, "budget_mb": 2.5}}
    cache = load_config(None, app.overrides(args)).cache
    assert (cache.key_bits, cache.value_bits, cache.budget_mb) == (8, 4, 2.5)
    with pytest.raises(ConfigError, match="cache.key_bits = 6: must be one of 32, 16, 8, 4"):
        load_config(None, app.overrides(app.parse_args(["--key-bits", "6"])))


def test_rolling_flag_turns_rolling_on():
    assert not load_config(None, app.overrides(app.parse_args([]))).cache.rolling
    args = app.parse_args(["--rolling", "--policy", "sink"])
    assert app.overrides(args) == {"cache": {"policy": "sink", "rolling": True}}
    assert load_config(None, app.overrides(args)).cache.rolling


@pytest.mark.parametrize(("server", "warning"), [
    ({}, None),
    ({"host": "::1"}, None),
    ({"host": "localhost"}, None),
    ({"host": "0.0.0.0", "username": "u", "password": "p"}, None),  # the API is off then
    ({"host": "0.0.0.0", "api_key": "k"},
     f"h2o-chat: warning: anyone who can reach this machine (server.host = 0.0.0.0) can use {PAGE_OPEN}"),
    ({"host": "box.lan"},
     f"h2o-chat: warning: anyone who can reach this machine (server.host = box.lan) can use {PAGE_OPEN} "
     f"and {API_OPEN}"),
    ({"share": True},
     f"h2o-chat: warning: anyone with the public share link (server.share) can use {PAGE_OPEN} and {API_OPEN}"),
])
def test_a_server_others_can_reach_unguarded_is_said_to_be_open(server, warning):
    assert exposure_warning(ServerConfig(**server)) == warning


def test_the_app_says_at_start_that_others_can_use_it(tmp_path):
    log = tmp_path / "app.log"
    with running_app("--host", "0.0.0.0", log_path=log):
        pass
    assert (f"h2o-chat: warning: anyone who can reach this machine (server.host = 0.0.0.0) can use {PAGE_OPEN} "
            f"and {API_OPEN}\n") in log.read_text()


def test_an_address_in_use_ends_the_start_with_one_line_naming_the_settings():
    """Bound before the model loads: no page address printed for a server that never
    listened, and no abort from a loader thread left inside torch at exit."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "app.py", "--port", str(port)], capture_output=True, text=True,
                                timeout=300, cwd=Path(app.__file__).parent)
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == (f"error: server.host = '127.0.0.1', server.port = {port}: "
                             "cannot listen there: Address already in use\n")


def test_a_flag_is_taken_only_spelled_out():
    """An abbreviation was taken for the flag it began: "--sha" turned on the public share link."""
    with pytest.raises(SystemExit):
        app.parse_args(["--sha"])


def test_a_model_that_fails_to_load_is_named_with_its_setting(tmp_path):
    """The libraries' own messages rarely say which model failed ("Should have a
    model_type key in its config.json" for an empty folder)."""
    from h2o_chat.config import ModelConfig
    from h2o_chat.loading import load_model
    from h2o_chat.runtime import ModelProvider

    empty = tmp_path / "empty-model"
    empty.mkdir()
    provider = ModelProvider(lambda: load_model(ModelConfig(source=str(empty))), str(empty)).start()
    with pytest.raises(RuntimeError):
        provider.get()
    assert provider.failure.startswith(f"the model {empty} (model.source) failed to load: ")


def test_a_byte_budget_with_slot_counts_is_refused(capsys):
    """The budget sets both counts: the ones given were dropped without a word."""
    with pytest.raises(SystemExit):
        app.parse_args(["--budget-mb", "5", "--heavy", "10"])
    assert "--budget-mb sets the heavy and recent slots itself" in capsys.readouterr().err


def test_what_the_app_holds_once_loaded_is_kept_out_of_the_collectors_passes():
    """The app's loader leaves the collector nothing of what loading made to walk: a full
    collection (one at every closed tab) walked it in 150-190 ms, stopping every reply.
    In a process of its own: freezing is for the whole process."""
    code = ("import gc, app; from h2o_chat.config import load_config; "
            "app.load_for_serving(load_config(None).model); print(gc.get_freeze_count(), len(gc.get_objects()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(app.__file__).parent)
    assert out.returncode == 0, out.stderr[-2000:]
    frozen, tracked = map(int, out.stdout.split())
    assert frozen > 100_000 and tracked < 1_000
