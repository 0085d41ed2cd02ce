"""The guard against tests that read files a fresh clone does not have. On the developers'
machines the repository has neighbours (such as ``../shared/data``, the benchmarks' data);
a user who clones the project into any folder has none of them, so a test that reads one
passes here and fails there.

The guard notes every file a test opens in what lay beside the repository (the other
entries of its parent folder) when the run began. A clone may sit in a folder that also
holds the temp folder or the caches of tools (directly in /tmp or in the home folder), so
the guard leaves out what is not the project's business: files this process created since
the run began (temp files and folders, a converted model), hidden entries (tools' caches,
configuration and sockets), and the folders of tools given to it (pytest's temp folder,
the model cache, the Python installation)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from h2o_chat.loading import cache_root

_WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT
_watching: list[BesideRepository] = []


def _real(path: str | bytes | os.PathLike) -> str:
    return os.path.realpath(os.fsdecode(path))


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


class BesideRepository:
    """Notes, in ``opened``, the files opened while ``watching`` that lay beside ``repo``
    when the guard was made, except in ``exempt`` folders, hidden entries and what this
    process created meanwhile. Paths are compared with symbolic links resolved, so a link
    inside the repository to a neighbour counts as the neighbour."""

    def __init__(self, repo: Path, exempt: Iterable[str | os.PathLike] = ()) -> None:
        self.repo = _real(repo)
        self.parent = os.path.dirname(self.repo)
        self.neighbours = {name for name in os.listdir(self.parent)
                           if not name.startswith(".") and os.path.join(self.parent, name) != self.repo}
        # A folder holding the repository would exempt everything beside it.
        self.exempt = [folder for folder in map(_real, exempt) if not _within(self.repo, folder)]
        self.created: set[str] = set()
        self.opened: list[str] = []

    def is_beside(self, path: str) -> bool:
        """Whether ``path`` (resolved) is in what lay beside the repository and is not
        left out."""
        if not path.startswith(self.parent.rstrip(os.sep) + os.sep):
            return False
        if path[len(self.parent.rstrip(os.sep)) + 1:].split(os.sep)[0] not in self.neighbours:
            return False
        if any(_within(path, folder) for folder in self.exempt):
            return False
        ancestor = path
        while ancestor != self.parent:
            if ancestor in self.created:
                return False
            ancestor = os.path.dirname(ancestor)
        return True

    def note(self, event: str, args: tuple) -> None:
        """What an audit hook hears (``sys.addaudithook``): opens, new folders, renames.
        Writing into an existing file beside the repository counts as opening it."""
        # The hook runs before the call: what does not exist yet is what this call creates.
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = _real(args[0])
            if args[2] & _WRITES and not os.path.lexists(path):
                self.created.add(path)
            elif self.is_beside(path):
                self.opened.append(path)
        elif event == "os.mkdir" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = _real(args[0])
            if not os.path.lexists(path):
                self.created.add(path)
        elif event == "os.rename" and isinstance(args[1], (str, bytes, os.PathLike)):
            self.created.add(_real(args[1]))

    @contextmanager
    def watching(self) -> Iterator[BesideRepository]:
        _watching.append(self)
        try:
            yield self
        finally:
            _watching.remove(self)


def tool_folders(pytest_temp: Path) -> list[str]:
    """The folders of tools that a test may read whatever they hold: pytest's temp folder
    of this run, the converted-model cache, the Python installation and its import paths."""
    return [str(pytest_temp), str(cache_root()), sys.prefix, sys.base_prefix, sys.exec_prefix,
            *(entry for entry in sys.path if entry)]


def _hear(event: str, args: tuple) -> None:
    for guard in _watching:
        guard.note(event, args)


sys.addaudithook(_hear)
