"""A named table: entries registered once under a name, then looked up by that name.

Every pluggable part of winnow is one: the RL loop's methods (``pipeline.rl.registry``) and
the rollout backends (``pipeline.rollout.backends``). An unknown name fails with the allowed
ones listed, so a typo in a config names its own fix. It sits on the bottom floor (it imports
nothing of winnow), so any floor may hold a table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

Entry = TypeVar("Entry")


class Registry(Generic[Entry]):
    """A named table of entries; an unknown name fails with the allowed ones listed (``ValueError``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # what one entry is, in messages: "advantage", "rollout backend"
        self._entries: dict[str, Entry] = {}

    def add(self, name: str, entry: Entry) -> Entry:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._entries[name] = entry
        return entry

    def register(self, name: str) -> Callable[[Entry], Entry]:
        """``add`` as a decorator."""
        return lambda entry: self.add(name, entry)

    def get(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of {self.names()}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def values(self) -> list[Entry]:
        """The entries, in the order of their names."""
        return [self._entries[name] for name in self.names()]

    def __contains__(self, name: object) -> bool:
        return name in self._entries
