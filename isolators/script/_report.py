"""What a script run reports: one ``StepResult`` a step, in order, and a summary.

Rules:
- A step's result has its number, line, action, what it did in words
  (``call``), its name or that (``title``), whether it held, a detail, and
  for a broken expectation the expected and the actual outcome.
- ``format_result`` gives the lines ``run`` and ``demo`` print for a step;
  ``ScriptReport.summary()`` the last line: every expectation held, or the
  lines of the steps that did not.
"""

from __future__ import annotations

import msgspec


class StepResult(msgspec.Struct, kw_only=True):
    """The outcome of one step."""

    number: int
    line: int
    action: str
    call: str
    """What the step did, in words (``prepare c1 (gpus:2)``)."""
    title: str
    """The step's name, or its ``call``."""
    ok: bool
    detail: str
    expected: str | None = None
    actual: str | None = None


class ScriptReport(msgspec.Struct, kw_only=True):
    """Every step's outcome, in order."""

    name: str
    backend: str
    results: list[StepResult] = []
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def failures(self) -> list[StepResult]:
        return [r for r in self.results if not r.ok]

    def summary(self) -> str:
        good = sum(r.ok for r in self.results)
        text = (f"{self.name} on {self.backend}: {len(self.results)} steps, {good} passed,"
                f" {len(self.results) - good} failed in {self.seconds:.2f} s")
        if self.passed:
            return text + ": every expectation held"
        lines = ", ".join(str(r.line) for r in self.failures)
        return text + f": FAILED (line{'s' if len(self.failures) > 1 else ''} {lines})"


def format_result(result: StepResult) -> list[str]:
    """The report lines of one step, as ``run`` and ``demo`` print them."""
    mark = "ok  " if result.ok else "FAIL"
    head = f"  {mark} {result.number:>3}  line {result.line:<4} "
    pad = " " * len(head)
    if result.title != result.call:
        lines = [f"{head}{result.title}", f"{pad}{result.call} -> {result.detail}"]
    else:
        lines = [f"{head}{result.call} -> {result.detail}"]
    if result.expected is not None:
        lines.append(f"{pad}expected: {result.expected}")
        lines.append(f"{pad}actual:   {result.actual}")
    return lines
