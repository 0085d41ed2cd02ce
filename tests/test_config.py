"""Config loading and validation: defaults, every kind of bad value, overrides."""

from __future__ import annotations

import dataclasses
import os
import re
import textwrap
from pathlib import Path

import pytest
import yaml

from h2o_chat.config import (
    DEFAULT_CONFIG_PATH,
    AppConfig,
    CacheConfig,
    ConfigError,
    GenerationConfig,
    load_config,
    quoted,
    validate,
)


def write(tmp_path, text: str):
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def error_for(tmp_path, text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    return info.value


# --- defaults ---------------------------------------------------------------------------


def test_default_file_equals_dataclass_defaults():
    assert load_config() == AppConfig()


def test_default_file_states_every_field_with_its_default():
    raw = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text(encoding="utf-8"))
    defaults = AppConfig()
    assert set(raw) == {f.name for f in dataclasses.fields(AppConfig)}
    for section_name, values in raw.items():
        section = getattr(defaults, section_name)
        assert set(values) == {f.name for f in dataclasses.fields(section)}, section_name
        for key, value in values.items():
            assert value == getattr(section, key), f"{section_name}.{key}"


def test_validate_accepts_defaults_built_in_code():
    assert validate(AppConfig()) == AppConfig()


def test_empty_file_and_missing_keys_keep_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == AppConfig()
    config = load_config(write(tmp_path, "cache:\n  heavy: 16\ngeneration:\n"))
    assert config.cache == CacheConfig(heavy=16)
    assert config.generation == GenerationConfig()


def test_int_is_accepted_for_float_field(tmp_path):
    config = load_config(write(tmp_path, "generation:\n  temperature: 1\n  top_p: 1\n"))
    assert config.generation.temperature == 1.0
    assert isinstance(config.generation.temperature, float)


def test_nullable_fields_accept_null_and_values(tmp_path):
    config = load_config(
        write(tmp_path, "model:\n  quantization: 4bit\n  threads: 2\ngeneration:\n  seed: 0\n")
    )
    assert (config.model.quantization, config.model.threads, config.generation.seed) == (
        "4bit",
        2,
        0,
    )


# --- bad values -------------------------------------------------------------------------


def test_unknown_key_names_it_and_lists_allowed(tmp_path):
    err = error_for(tmp_path, "cache:\n  heavvy: 3\n")
    assert err.field == "cache.heavvy"
    assert "cache.heavvy: unknown key" in str(err)
    assert "allowed: policy, heavy, recent, sink, score_norm, prefill_chunk_size" in str(err)
    assert "did you mean 'heavy'" in str(err)


def test_unknown_section(tmp_path):
    err = error_for(tmp_path, "caches:\n  heavy: 3\n")
    assert "caches: unknown section" in str(err)
    assert "model, cache, generation, server" in str(err)


def test_section_that_is_not_a_mapping(tmp_path):
    err = error_for(tmp_path, "cache: 5\n")
    assert err.field == "cache"
    assert "expected a mapping" in str(err)


def test_top_level_that_is_not_a_mapping(tmp_path):
    assert "expected a mapping" in str(error_for(tmp_path, "- a\n- b\n"))


@pytest.mark.parametrize(
    "section, key, value, expected",
    [
        ("cache", "heavy", "many", "expected int"),
        ("cache", "heavy", 1.5, "expected int"),
        ("generation", "temperature", "hot", "expected float"),
        ("server", "port", "7860", "expected int"),
        ("server", "host", 127, "expected str"),
        ("server", "share", "yes", "expected bool"),
        ("model", "trust_remote_code", 1, "expected bool"),
        ("generation", "seed", 1.0, "expected int or null"),
        ("cache", "key_bits", "8", "expected int or null"),
        ("cache", "budget_mb", "1 GB", "expected float or null"),
    ],
)
def test_wrong_type(tmp_path, section, key, value, expected):
    err = error_for(tmp_path, yaml.safe_dump({section: {key: value}}))
    assert err.field == f"{section}.{key}"
    assert f"{section}.{key} = {value!r}" in str(err)
    assert expected in str(err)


@pytest.mark.parametrize("section, key", [("cache", "heavy"), ("generation", "max_new_tokens")])
def test_bool_is_not_an_int(tmp_path, section, key):
    err = error_for(tmp_path, f"{section}:\n  {key}: true\n")
    assert err.field == f"{section}.{key}"
    assert "expected int, got bool" in str(err)


def test_bool_is_not_a_float(tmp_path):
    assert "expected float, got bool" in str(error_for(tmp_path, "generation:\n  top_p: true\n"))


@pytest.mark.parametrize(
    "section, key, value, allowed",
    [
        ("cache", "heavy", -3, "must be an integer >= 0"),
        ("cache", "recent", -1, "must be an integer >= 0"),
        ("cache", "sink", -1, "must be an integer >= 0"),
        ("cache", "prefill_chunk_size", 0, "must be an integer >= 1"),
        ("cache", "key_bits", 2, "must be one of 32, 16, 8, 4, or null"),
        ("cache", "value_bits", 64, "must be one of 32, 16, 8, 4, or null"),
        ("cache", "budget_mb", 0, "must be a number of megabytes > 0 and <= 1000000, or null"),
        ("generation", "max_new_tokens", 0, "from 1 to 32768"),
        ("generation", "max_new_tokens", 32769, "from 1 to 32768"),
        ("generation", "temperature", -0.1, "from 0 to 10"),
        ("generation", "temperature", 10.5, "from 0 to 10"),
        ("generation", "top_p", 0, "> 0 and <= 1"),
        ("generation", "top_p", 1.01, "> 0 and <= 1"),
        ("generation", "seed", -1, "from 0 to 9223372036854775807, or null"),
        ("generation", "seed", 2**63, "from 0 to 9223372036854775807, or null"),
        ("model", "threads", 0, "from 1 to 1024, or null"),
        ("model", "dtype", "float64", "auto, float32, bfloat16, float16"),
        ("model", "device", "tpu", "cpu, cuda, auto"),
        ("model", "quantization", "2bit", "4bit, 8bit, or null"),
        ("server", "port", 0, "from 1 to 65535"),
        ("server", "port", 65536, "from 1 to 65535"),
        ("server", "host", "", "a host name or IP address"),
        ("server", "max_message_chars", 0, "from 1 to 10000000"),
        ("server", "max_request_mb", 0, "from 1 to 1024"),
        ("server", "max_concurrent_generations", 0, "from 1 to 64"),
        ("server", "max_concurrent_generations", 65, "from 1 to 64"),
        ("server", "idle_release_minutes", 0, "> 0 and <= 10080"),
        ("server", "username", " ", "non-empty"),
        ("server", "password", "", "non-empty"),
    ],
)
def test_out_of_range(tmp_path, section, key, value, allowed):
    err = error_for(tmp_path, yaml.safe_dump({section: {key: value}}))
    assert err.field == f"{section}.{key}"
    assert f"{section}.{key} = {value!r}: " in str(err)
    assert allowed in str(err)


def test_exact_message_for_negative_heavy(tmp_path):
    err = error_for(tmp_path, "cache:\n  heavy: -3\n")
    assert str(err).startswith("cache.heavy = -3: must be an integer >= 0")


def test_policy_not_in_set(tmp_path):
    err = error_for(tmp_path, "cache:\n  policy: lru\n")
    assert err.field == "cache.policy"
    assert "cache.policy = 'lru'" in str(err)
    assert "full, h2o, recent, sink" in str(err)


@pytest.mark.parametrize("policy", ["full", "h2o", "recent", "sink"])
def test_every_policy_is_accepted(policy):
    assert load_config(overrides={"cache": {"policy": policy}}).cache.policy == policy


def test_h2o_needs_an_evictable_slot():
    with pytest.raises(ConfigError, match=r"cache\.heavy \+ cache\.recent = 0"):
        load_config(overrides={"cache": {"policy": "h2o", "heavy": 0, "recent": 0}})
    # heavy alone or recent alone is enough
    assert load_config(overrides={"cache": {"heavy": 0, "recent": 1}}).cache.recent == 1
    assert load_config(overrides={"cache": {"heavy": 1, "recent": 0}}).cache.heavy == 1


@pytest.mark.parametrize("policy", ["recent", "sink"])
def test_window_policies_need_recent(policy):
    with pytest.raises(ConfigError, match=r"cache\.recent = 0") as info:
        load_config(overrides={"cache": {"policy": policy, "recent": 0}})
    assert info.value.field == "cache.recent"


def test_a_budget_in_bytes_needs_a_policy_that_evicts(tmp_path):
    err = error_for(tmp_path, "cache:\n  policy: full\n  budget_mb: 5\n")
    assert err.field == "cache.budget_mb"
    assert str(err).startswith("cache.budget_mb is set but cache.policy is 'full', which keeps every token")


def test_full_policy_ignores_budget():
    config = load_config(overrides={"cache": {"policy": "full", "heavy": 0, "recent": 0}})
    assert config.cache.policy == "full"


def test_invalid_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path, "cache:\n  heavy: 3\n  recent: [1, 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message
    assert "invalid YAML" in message
    assert f"{path}:4:" in message  # the flow sequence is left open at the end of the file


def test_invalid_yaml_indentation_line(tmp_path):
    path = write(tmp_path, "cache:\n  heavy: 3\n    recent: 4\n")
    with pytest.raises(ConfigError, match=rf"{str(path)!s}:3:"):
        load_config(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_file_errors_name_the_file(tmp_path):
    path = write(tmp_path, "cache:\n  heavy: -3\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_validate_checks_configs_built_in_code():
    config = AppConfig()
    config.cache.heavy = -3
    with pytest.raises(ConfigError, match=r"^cache\.heavy = -3: must be an integer >= 0$"):
        validate(config)
    config = AppConfig(generation=GenerationConfig(temperature=0))
    validated = validate(config)
    assert validated.generation.temperature == 0.0
    assert isinstance(validated.generation.temperature, float)


def test_validate_rejects_wrong_section_type():
    with pytest.raises(ConfigError, match="cache: expected CacheConfig"):
        validate(AppConfig(cache={"heavy": 3}))  # type: ignore[arg-type]


# --- overrides --------------------------------------------------------------------------


def test_overrides_apply_on_top_of_file(tmp_path):
    path = write(tmp_path, "cache:\n  heavy: 8\n  recent: 8\ngeneration:\n  seed: 1\n")
    config = load_config(
        path, overrides={"cache": {"recent": 32}, "server": {"port": 8080}}
    )
    assert config.cache == CacheConfig(heavy=8, recent=32)
    assert config.generation.seed == 1
    assert config.server.port == 8080


def test_overrides_on_default_file():
    config = load_config(overrides={"generation": {"temperature": 0, "max_new_tokens": 16}})
    assert config.generation.temperature == 0.0
    assert config.generation.max_new_tokens == 16
    assert config.cache == CacheConfig()


def test_override_can_fix_a_bad_file_value(tmp_path):
    path = write(tmp_path, "cache:\n  heavy: -3\n")
    assert load_config(path, overrides={"cache": {"heavy": 3}}).cache.heavy == 3


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"cache": {"heavvy": 1}}, "cache.heavvy"),
        ({"cachee": {"heavy": 1}}, "cachee"),
        ({"cache": {"heavy": -1}}, "cache.heavy"),
        ({"server": {"port": True}}, "server.port"),
        ({"cache": {"policy": "lru"}}, "cache.policy"),
    ],
)
def test_bad_overrides_are_rejected(overrides, field):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    assert info.value.field == field
    assert field in str(info.value)
    assert "overrides" in str(info.value)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_a_story_runs_a_turns_setting_as_h2o_split_evenly():
    from h2o_chat.config import CacheConfig, for_story

    turns = CacheConfig(policy="turns", heavy=240, recent=16, sink=4, budget_mb=2.0)
    story = for_story(turns)
    assert (story.policy, story.heavy, story.recent, story.sink, story.budget_mb) == ("h2o", 128, 128, 4, 2.0)
    for other in (CacheConfig(policy="h2o", heavy=240, recent=16), CacheConfig(policy="sink", recent=64)):
        assert for_story(other) is other


def test_turns_is_a_policy_of_the_config_and_needs_a_slot_to_evict():
    config = load_config(None, {"cache": {"policy": "turns", "heavy": 100, "recent": 8}})
    assert config.cache.policy == "turns"
    with pytest.raises(ConfigError, match=r"cache.heavy \+ cache.recent = 0: must be >= 1 when cache.policy is 'turns'"):
        load_config(None, {"cache": {"policy": "turns", "heavy": 0, "recent": 0}})


def test_a_yaml_alias_bomb_is_refused_by_name_without_expanding_it(tmp_path):
    """Under 500 bytes of nested aliases stand for billions of strings: quoting the value
    in the refusal once expanded them all, and memory grew by a GB every 25 s."""
    levels = ["&a0 [" + ",".join(["lol"] * 9) + "]"]
    levels += [f"&a{n} [" + ",".join([f"*a{n - 1}"] * 9) + "]" for n in range(1, 10)]
    path = write(tmp_path, "cache:\n  heavy: [" + ", ".join(levels) + "]\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    refusal = str(info.value).split(" (in ")[0]  # less the file's path, as long as the clone's folder
    assert refusal.startswith("cache.heavy = [[") and len(refusal) < 300


@pytest.mark.parametrize("text, message", [
    ("cache:\n  heavy: 10\n  heavy: 20\n", ":3:3: invalid YAML: 'heavy' is given twice: keep one"),
    ("cache:\n  heavy: 10\nserver:\n  port: 7861\ncache:\n  recent: 5\n",
     ":5:1: invalid YAML: 'cache' is given twice: keep one"),
    ("cache:\n  heavy: " + "9" * 5000 + "\n", ": invalid YAML: Exceeds the limit (4300 digits)"),
    ("cache: " + "[" * 100_000 + "]" * 100_000 + "\n", ": invalid YAML: nested too deeply to read"),
])
def test_config_files_that_cannot_be_read_as_given_are_refused_by_line(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(str(path)) and message in str(info.value)


def test_config_paths_that_are_not_a_text_file_are_refused(tmp_path):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("generation:\n  system_prompt: caf\xe9\n".encode("latin-1"))
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # opened, it would wait for a writer for ever
    big = write(tmp_path, "# padding\n" * 200_000)
    for path, message in [(latin1, "not UTF-8 text (byte 32): save the config as UTF-8"),
                          (fifo, "not a regular file: the config must be a YAML file"),
                          (Path("/dev/zero"), "not a regular file: the config must be a YAML file"),
                          (big, "config file over 1,000,000 bytes: not a config")]:
        with pytest.raises(ConfigError, match=re.escape(f"{path}: {message}")):
            load_config(path)
    assert load_config(Path(os.devnull)) == load_config(None)  # empty: the defaults


@pytest.mark.parametrize("name, value, message", [
    ("model.source", "", "must be a model folder, file or Hugging Face id, or null for the embedded model"),
    ("model.threads", 100_000_000, "must be an integer from 1 to 1024"),
    ("server.host", "a b", "must be a host name or IP address such as 127.0.0.1, 0.0.0.0 or ::1"),
    ("server.host", " 127.0.0.1 ", "must be a host name or IP address"),
    ("server.api_key", "é€ключ", "of printable ASCII characters"),
])
def test_start_up_settings_are_refused_by_name(name, value, message):
    section, key = name.split(".")
    with pytest.raises(ConfigError) as info:
        load_config(None, {section: {key: value}})
    assert str(info.value).startswith(f"{name} = {value!r}: ") and message in str(info.value)


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::1", "::", "localhost", "my-box.local"])
def test_hosts_are_names_or_addresses(host):
    assert load_config(None, {"server": {"host": host}}).server.host == host


@pytest.mark.parametrize("text, message", [
    ("cache:\n  heavy: 1:30\n", "cache.heavy = '1:30': expected int, got str"),  # YAML 1.1: 90, base 60
    ("server:\n  share: yes\n", "server.share = 'yes': expected bool, got str"),  # YAML 1.1: true
    ("model:\n  trust_remote_code: on\n", "model.trust_remote_code = 'on': expected bool, got str"),
])
def test_plain_values_read_as_yaml_1_2_reads_them(tmp_path, text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(write(tmp_path, text))


def test_numbers_with_exponents_are_numbers(tmp_path):
    config = load_config(write(tmp_path, "cache:\n  budget_mb: 1e1\n"))
    assert config.cache.budget_mb == 10.0


def test_a_gguf_file_without_its_source_is_refused():
    """It was ignored, and the embedded model loaded."""
    with pytest.raises(ConfigError, match="model.gguf_file is set but model.source is not"):
        load_config(None, {"model": {"gguf_file": "model.Q4_K_M.gguf"}})


@pytest.mark.parametrize("value, limit, shown", [
    ("x" * 100, 40, "'" + "x" * 38 + "…"),  # reprlib's '...' in the middle is not kept half
    ("image" + "." * 200, 12, "'image.....…"),  # a value's own dots are kept
    ("abc", 5, "'abc'"),
    (True, 40, "true"),
    (10 ** 400, 40, "<a 401-digit number>"),
    (list(range(100)), 12, "[0, 1, 2, 3…"),
    ("x" * 50, None, "'" + "x" * 50 + "'"),
])
def test_a_quoted_value_is_cut_to_its_limit_and_the_cut_marked(value, limit, shown):
    assert quoted(value, limit) == shown
