"""The suite runs from a clone wherever a newcomer puts it. Each case clones this
repository (its committed state) into a folder of its own, plants beside it a
``shared/data/README.md`` as the developers' machines have, and runs a part of the suite
in the clone with this interpreter: the tests that write temp files and the guard's own
tests pass, and a probe test that reads the planted file fails with the guard's message.
The clones sit directly in the temp folder (/tmp), directly in a home folder, and in a path
with a space and a non-ASCII character."""

import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUBSET = ["tests/test_beside_repo.py", "tests/test_config.py"]
PROBE = "tests/test_probe_reads_beside.py"


@pytest.fixture
def in_temp_folder():
    """A clone directly in /tmp, whose neighbour gets a unique name (never /tmp/shared,
    which other users of the machine may have)."""
    clone = Path(tempfile.mkdtemp(prefix="h2o-chat-clone-"))
    neighbour = Path(tempfile.mkdtemp(prefix="h2o-chat-shared-"))
    yield clone, neighbour, {}
    shutil.rmtree(clone)
    shutil.rmtree(neighbour)


@pytest.fixture
def in_home_folder(tmp_path):
    home = tmp_path / "home"
    yield home / "h2o-chat", home / "shared", {"HOME": str(home)}


@pytest.fixture
def in_a_path_with_space_and_accent(tmp_path):
    projects = tmp_path / "Mes projets"
    yield projects / "h2o chat é", projects / "shared", {}


def _outcomes(report: Path) -> dict[str, str]:
    """Each test of a JUnit XML report: ``passed`` or the message of what went wrong."""
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        problem = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        outcomes[f"{case.get('classname')}.{case.get('name')}"] = (
            "passed" if problem is None else f"{problem.tag}: {problem.get('message')}")
    return outcomes


@pytest.mark.parametrize("place", ["in_temp_folder", "in_home_folder", "in_a_path_with_space_and_accent"])
def test_a_clone_passes_its_tests_and_its_guard_catches_a_read_beside_it(place, request, tmp_path):
    clone, neighbour, env = request.getfixturevalue(place)
    clone.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    readme = neighbour / "data" / "README.md"
    readme.parent.mkdir(parents=True)
    readme.write_text("data a clone does not have\n")
    (clone / PROBE).write_text(
        "from pathlib import Path\n\n\n"
        "def test_reads_shared_data():\n"
        f"    (Path(__file__).resolve().parents[2] / {neighbour.name!r} / 'data' / 'README.md').read_text()\n")

    report = tmp_path / "report.xml"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}, **env}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          f"--basetemp={tmp_path / 'basetemp'}", f"--junitxml={report}", *SUBSET, PROBE],
                         cwd=clone, env=env, capture_output=True, text=True, timeout=900)

    outcomes = _outcomes(report)
    wrong = {name: outcome for name, outcome in outcomes.items()
             if outcome != "passed" and not name.endswith("test_reads_shared_data")}
    assert not wrong, run.stdout[-4000:]
    assert len(outcomes) > 40  # the subset ran: 38 tests and more, not an empty collection
    probe = outcomes["tests.test_probe_reads_beside.test_reads_shared_data"]
    assert probe == ("error: failed on teardown with \"AssertionError: the test opened files outside "
                     f"the repository: ['{readme.resolve()}']\nassert not ['{readme.resolve()}']\""), probe
    assert run.returncode == 1
