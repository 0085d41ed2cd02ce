import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Set before torch is imported, as app.py does: the test workers, the apps and the browsers
# share the cores, and idle OpenMP threads that spin stall them all.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import h2o_chat  # noqa: F401  (registers the h2o attention)
from h2o_chat.engine.attention import ATTENTION_NAME

from .beside_repo import BesideRepository, tool_folders
from .reference import register_reference

register_reference()

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def files_beside_repo(tmp_path_factory):
    """The run's guard against reading what lies beside the repository (see beside_repo)."""
    with BesideRepository(REPO, tool_folders(tmp_path_factory.getbasetemp())).watching() as guard:
        yield guard


@pytest.fixture(autouse=True)
def reads_only_what_the_project_ships(files_beside_repo):
    files_beside_repo.opened.clear()
    yield
    opened = sorted(set(files_beside_repo.opened))
    assert not opened, f"the test opened files outside the repository: {opened}"


@pytest.fixture(scope="session")
def tiny_model():
    """A random-weight Llama with GQA (4 query heads share 2 KV heads): fast and exact."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        attn_implementation=ATTENTION_NAME,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2-135M-Instruct, loaded once for the whole run."""
    from h2o_chat.loading import load_model

    return load_model()


@pytest.fixture(scope="session")
def browser():
    """One headless Debian chromium for every browser test (each test opens its own
    contexts, i.e. its own Gradio sessions)."""
    from playwright.sync_api import sync_playwright

    from .browser_support import chromium

    with sync_playwright() as playwright, chromium(playwright) as browser:
        yield browser


@pytest.fixture(scope="session")
def app_log(tmp_path_factory):
    return tmp_path_factory.mktemp("app") / "server.log"


@pytest.fixture(scope="session")
def app_url(app_log):
    """The app on its default settings, started once for every browser test module that
    asks for no settings of its own (a start costs tens of seconds on a small machine).
    What it printed is kept in ``app_log``."""
    from .browser_support import running_app

    with running_app(log_path=app_log) as url:
        yield url


@pytest.fixture
def page(browser, app_url):
    """A page of the app that the test module's ``app_url`` fixture serves, in a browser
    context (a Gradio session) of its own."""
    from .browser_support import open_app

    page = open_app(browser, app_url)
    yield page
    page.context.close()
