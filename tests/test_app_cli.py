"""app.py's flags become config overrides; only the flags given override the file."""

import pytest

import app
from h2o_chat.config import ConfigError, load_config


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
