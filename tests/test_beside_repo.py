"""The guard of conftest (tests/beside_repo.py) catches a read of what lies beside the
repository, ``../shared/data`` first, and leaves temp files, caches and tools alone,
wherever the clone sits. Each test lays out a parent folder with a clone in it."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from .beside_repo import BesideRepository


def _layout(parent: Path) -> Path:
    """A clone in ``parent`` with the developers' ``../shared/data/README.md`` beside it."""
    (parent / "h2o-chat" / "tests").mkdir(parents=True)
    (parent / "shared" / "data").mkdir(parents=True)
    (parent / "shared" / "data" / "README.md").write_text("data a clone does not have\n")
    return parent / "h2o-chat"


def test_a_read_of_shared_data_beside_the_repository_is_caught(tmp_path):
    clone = _layout(tmp_path)
    with BesideRepository(clone).watching() as guard:
        (clone / "tests" / "../../shared/data/README.md").read_text()
        (clone / "tests" / "own.txt").write_text("the clone's own file")
        (clone / "tests" / "own.txt").read_text()
    assert guard.opened == [str((tmp_path / "shared" / "data" / "README.md").resolve())]


def test_a_link_inside_the_repository_to_shared_data_is_caught(tmp_path):
    clone = _layout(tmp_path)
    (clone / "data").symlink_to(tmp_path / "shared" / "data")
    with BesideRepository(clone).watching() as guard:
        (clone / "data" / "README.md").read_text()
    assert guard.opened == [str((tmp_path / "shared" / "data" / "README.md").resolve())]


def test_writing_into_an_existing_neighbour_is_caught(tmp_path):
    clone = _layout(tmp_path)
    with BesideRepository(clone).watching() as guard:
        with open(tmp_path / "shared" / "data" / "README.md", "a") as readme:
            readme.write("more")
        (tmp_path / "shared").mkdir(exist_ok=True)  # an existing folder is not made by the run
        (tmp_path / "shared" / "data" / "README.md").read_text()
    assert guard.opened == [str((tmp_path / "shared" / "data" / "README.md").resolve())] * 2


def test_what_the_run_creates_hidden_entries_and_tool_folders_are_left_alone(tmp_path):
    clone = _layout(tmp_path)
    for tool in (".cache/matplotlib", "tools/cache"):
        (tmp_path / tool).mkdir(parents=True)
        (tmp_path / tool / "fontlist.json").write_text("{}")
    with BesideRepository(clone, exempt=[tmp_path / "tools"]).watching() as guard:
        made = tmp_path / "h2o-chat-files-run"  # as a temp folder beside a clone in /tmp
        made.mkdir()
        (made / "upload.txt").write_text("uploaded")
        (made / "upload.txt").read_text()
        (tmp_path / "written.log").write_text("log")
        (tmp_path / "written.log").read_text()
        (tmp_path / ".cache/matplotlib/fontlist.json").read_text()
        (tmp_path / "tools/cache/fontlist.json").read_text()
        (tmp_path / "shared" / "data" / "README.md").read_text()
    assert guard.opened == [str((tmp_path / "shared" / "data" / "README.md").resolve())]


def test_a_folder_holding_the_repository_exempts_nothing_beside_it(tmp_path):
    clone = _layout(tmp_path)
    with BesideRepository(clone, exempt=[tmp_path]).watching() as guard:
        (tmp_path / "shared" / "data" / "README.md").read_text()
    assert guard.opened == [str((tmp_path / "shared" / "data" / "README.md").resolve())]


@pytest.fixture
def clone_in_the_temp_folder():
    """A clone directly in the system's temp folder (/tmp), with its own neighbour there
    (a unique name, not /tmp/shared, which other users may have); removed afterwards."""
    clone = Path(tempfile.mkdtemp(prefix="h2o-chat-clone-"))
    shared = Path(tempfile.mkdtemp(prefix="h2o-chat-shared-"))
    (shared / "README.md").write_text("data a clone does not have\n")
    yield clone, shared / "README.md"
    shutil.rmtree(clone)
    shutil.rmtree(shared)


def test_in_the_temp_folder_temp_files_pass_and_a_neighbour_is_caught(clone_in_the_temp_folder):
    clone, neighbour = clone_in_the_temp_folder
    assert os.path.dirname(clone) == tempfile.gettempdir()
    with BesideRepository(clone).watching() as guard:
        with tempfile.NamedTemporaryFile("w+", prefix="h2o-chat-app-", suffix=".log") as log:
            log.write("started")
            log.flush()
            Path(log.name).read_text()
        folder = Path(tempfile.mkdtemp(prefix="h2o-chat-files-"))
        (folder / "upload.txt").write_text("uploaded")
        (folder / "upload.txt").read_text()
        shutil.rmtree(folder)
        neighbour.read_text()
    assert guard.opened == [str(neighbour.resolve())]
