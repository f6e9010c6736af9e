"""Processes that runtime tests watch.

Rules:
- ``LogProcess`` appends to ``log`` what happens to it: ``"finalize"`` and
  every value it is asked to ``record`` (which it returns). Tests subclass
  it for the hooks they watch.
"""

from __future__ import annotations

from typing import Any

from runtime import Process

__all__ = ["LogProcess"]


class LogProcess(Process):
    """A process that logs its finalize and what it records (see the module rules)."""

    def __init__(self, id: str | None = None) -> None:
        super().__init__(id=id)
        self.log: list[Any] = []

    def finalize(self) -> None:
        self.log.append("finalize")

    def record(self, value: Any) -> Any:
        self.log.append(value)
        return value
