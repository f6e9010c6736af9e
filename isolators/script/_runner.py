"""Running a message script on a simulated node.

Rules:
- The runner drives the isolator actor through its handle (dispatch), on a
  ``SimulatedNode`` of its own: a temp dir and a fresh cgroups root
  (``gpu-isolator-script-<random>`` unless given), removed at the end with
  every container left behind (``SimulatedNode.close``).
- Unless the first step is ``create``, the node starts with the script's
  flags and an empty recover; a node that cannot start is one ScriptError.
- Each step is its action's ``perform``; a failure is compared with
  ``expect.error`` (a case-insensitive substring; an isolator call's
  failure must also be an ``IsolatorError``), a success with
  ``expect.result`` (a subset: mappings match on the keys given, lists
  element by element) and the action's own ``check``.
- Every step is reported as it completes (its number, line, what it did
  and the outcome, through ``echo``); a broken expectation shows expected
  and actual. A run never stops early, so one run shows every broken
  expectation; then a summary.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import msgspec

from runtime import Clock

from .._errors import IsolatorError
from ..simulated_node import SimulatedNode
from ._action import ACTIONS, Mismatch, ScriptError, error_text, short, wrong_error
from ._format import BACKENDS, Script, action_title, host_document
from ._report import ScriptReport, StepResult, format_result

logger = logging.getLogger(__name__)


class ScriptRunner:
    """Runs one script on one backend and reports every step (see module rules).

    Actions use ``node`` (the simulated node), ``isolator`` and
    ``components`` (what runs on it now), ``rootfs_dir`` (where ``rootfs``
    names are made) and ``created`` (the flags of the last ``create``)."""

    def __init__(self, script: Script, backend: str | None = None,
                 echo: Callable[[str], None] | None = None, cgroups_root: str | None = None) -> None:
        self.script = script
        backend = backend or script.node.backend
        if backend not in BACKENDS:
            raise ScriptError(f"Unknown backend {backend!r}: expected one of {', '.join(BACKENDS)}")
        node = script.node
        self.node = SimulatedNode(
            backend=backend,
            host=node.host_file if node.host_file is not None else host_document(node),
            cgroups_root=cgroups_root,
            root_prefix="gpu-isolator-script-",
            extra=node.flags,
        )
        self.created: dict[str, Any] | None = None
        self.report = ScriptReport(name=script.name or "script", backend=backend)
        self.echo = echo or (lambda line: None)

    @property
    def backend(self) -> str:
        return self.node.backend

    @property
    def isolator(self) -> Any:
        return self.node.isolator

    @property
    def components(self) -> Any:
        return self.node.components

    @property
    def rootfs_dir(self) -> str:
        return self.node.path("rootfs")

    async def run(self) -> ScriptReport:
        started = time.monotonic()
        try:
            await self.node.setup()
            if self.script.steps[0].create is None:
                try:
                    _components, isolator = await self.node.start()
                    await isolator.recover([], set())
                except Exception as e:
                    raise ScriptError(
                        f"{getattr(self.script, 'source', 'script')}: cannot start the node on"
                        f" {self.backend}: {e}") from None
            for step in self.script.steps:
                await self._run_step(step)
        finally:
            if Clock.paused():
                Clock.resume()
            await self.node.close()
        self.report.seconds = time.monotonic() - started
        self.echo(self.report.summary())
        return self.report

    def _record(self, step: Any, ok: bool, detail: str, expected: str | None = None,
                actual: str | None = None) -> None:
        call = action_title(step)
        result = StepResult(number=len(self.report.results) + 1, line=getattr(step, "line", 0),
                            action=step.action, call=call, title=step.name or call, ok=ok, detail=detail,
                            expected=expected, actual=actual)
        self.report.results.append(result)
        for line in format_result(result):
            self.echo(line)

    async def _run_step(self, step: Any) -> None:
        action = ACTIONS[step.action]
        args = getattr(step, step.action)
        try:
            if action.needs_isolator and self.isolator is None:
                raise IsolatorError("No isolator is running: an earlier 'create' step failed")
            outcome = await action.perform(self, args, step.expect)
        except Mismatch as e:
            self._record(step, False, e.detail, e.expected, e.actual)
            return
        except Exception as e:  # a failed call: compare with the expected error
            self._check_error(step, e)
            return
        if step.expect.error is not None:
            self._record(step, False, "succeeded", f"an error containing {step.expect.error!r}",
                         "success: " + await self._describe(step, outcome))
            return
        try:
            await action.check(self, args, step.expect, outcome)
            if step.expect.result is not None:
                _check_result(step.expect.result, outcome)
        except Mismatch as e:
            self._record(step, False, e.detail, e.expected, e.actual)
            return
        self._record(step, True, await self._describe(step, outcome))

    def _check_error(self, step: Any, error: BaseException) -> None:
        text = error_text(error)
        wanted = step.expect.error
        wrong = wrong_error(ACTIONS[step.action], error)
        if wrong is not None:
            self._record(step, False, f"failed with the wrong error type: {wrong}",
                         "an IsolatorError" + (f" containing {wanted!r}" if wanted is not None else ""),
                         f"error: {wrong}")
        elif wanted is None:
            self._record(step, False, f"failed: {text}", "success", f"error: {text}")
        elif wanted.lower() in text.lower():
            self._record(step, True, f"refused as expected: {text}")
        else:
            self._record(step, False, f"failed: {text}", f"an error containing {wanted!r}", f"error: {text}")

    async def _describe(self, step: Any, outcome: Any) -> str:
        try:
            return await ACTIONS[step.action].describe(self, getattr(step, step.action), outcome)
        except Exception as e:  # the step held; only the description failed
            logger.warning("script: cannot describe the outcome of %s: %s", step.action, e)
            return "done"


def _check_result(expected: Any, outcome: Any) -> None:
    actual = msgspec.to_builtins(outcome) if outcome is not None else None
    problem = _subset(expected, actual)
    if problem:
        path, wanted, got = problem
        raise Mismatch(f"{path} = {wanted}", f"{path} = {got}", f"{path} differs")


def _subset(expected: Any, actual: Any, path: str = "result") -> tuple[str, str, str] | None:
    """The first place where ``actual`` does not match ``expected``: mappings
    match on the keys given, lists element by element, other values by
    equality. ``(path, expected, actual)`` or None."""
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return path, "a mapping", short(repr(actual))
        for k, v in expected.items():
            if k not in actual:
                return f"{path}.{k}", repr(v), f"no '{k}' (fields: {', '.join(map(str, actual))})"
            problem = _subset(v, actual[k], f"{path}.{k}")
            if problem:
                return problem
        return None
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return path, f"{len(expected)} items", short(f"{len(actual)} items: {actual!r}")
        for i, (e, a) in enumerate(zip(expected, actual)):
            problem = _subset(e, a, f"{path}[{i}]")
            if problem:
                return problem
        return None
    if expected != actual and not (isinstance(expected, (int, float)) and not isinstance(expected, bool)
                                   and isinstance(actual, (int, float)) and not isinstance(actual, bool)
                                   and float(expected) == float(actual)):
        return path, repr(expected), short(repr(actual))
    return None


async def run_script(script: Script, backend: str | None = None,
                     echo: Callable[[str], None] | None = None,
                     cgroups_root: str | None = None) -> ScriptReport:
    """Run ``script`` (inside a running ``runtime.Runtime``) on ``backend``
    (default: the script's ``node.backend``) and report every step through
    ``echo``. ``cgroups_root`` names the run's own root (default: a fresh
    ``gpu-isolator-script-<random>``); it is removed at the end."""
    return await ScriptRunner(script, backend, echo, cgroups_root).run()
