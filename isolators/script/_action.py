"""What every step action is, and the registry that makes the format.

Rules:
- An action is one class (a subclass of ``Action`` decorated with
  ``@action``): its ``name`` is the step's key, ``args`` the msgspec type of
  the key's value, ``expects`` the expectations a step of it may have
  (``Expect`` fields; ``error`` means the step may be expected to fail),
  ``in_concurrent`` whether it may stand inside ``concurrent``,
  ``needs_isolator`` whether it needs a running isolator, ``isolator_call``
  whether it calls an isolator method: such a step that fails must fail
  with an ``IsolatorError`` (SPEC 11: every failure of an isolator method
  is one, whichever actor it came from); another type is a broken
  expectation of its own (``wrong_error``), whatever the text.
- Everything about an action lives in its class: the words of a step
  (``title``), the checks loading makes beyond types (``validate``, with
  paths relative to the script resolved by ``resolve``), what it does
  (``perform``; for actions allowed inside ``concurrent``, ``call``, a
  Future of one isolator call), its own expectations (``check``; ``error``
  and ``result`` are checked by the runner for every action) and the words
  of its outcome (``describe``).
- ``ACTIONS`` holds the registered actions in registration order (the order
  errors list them in); the step types of the format are built from it, so
  adding an action is adding its class.
- A broken expectation raises ``Mismatch(expected, actual, detail)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, NoReturn

import msgspec

from runtime import Future

from .._errors import IsolatorError

if TYPE_CHECKING:
    from ._runner import ScriptRunner

MAX_SCRIPT_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_NODES = 200_000
MAX_STEPS = 10_000
MAX_CALLS = 100_000
MAX_REPEAT = 10_000

RUNNER_FLAGS = ("host_file", "dev_dir", "runtime_dir", "work_dir", "volume_dir", "cgroups_root",
                "cgroups_hierarchy", "device_backend")
"""Flags the runner sets for every run; ``create`` may still name a ``host_file``."""

Id = Annotated[str, msgspec.Meta(min_length=1, max_length=1000)]
Text = Annotated[str, msgspec.Meta(max_length=10_000)]
Minor = Annotated[int, msgspec.Meta(ge=0, le=(1 << 20) - 1)]
MigText = Annotated[str, msgspec.Meta(pattern=r"^\d{1,4}:\d{1,7}/gi\d{1,3}/ci\d{1,3}$", max_length=40)]
"""A MIG device as ``195:0/gi3/ci0`` (R-MG-3)."""
Unit = Minor | MigText
"""A whole GPU by minor, or a MIG device."""
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_CALLS)]


class ScriptError(IsolatorError, ValueError):
    """A script that cannot be read, decoded or run; one line naming the field."""


class Expect(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What a step expects (which fields apply: its action's ``expects``)."""

    error: Text | None = None
    gpus: list[Unit] | None = None
    """Whole GPUs by minor; MIG devices as ``195:0/gi3/ci0``."""
    count: Count | None = None
    none: bool | None = None
    result: dict[str, Any] | list[Any] | None = None
    ok: Count | None = None
    failed: Count | None = None
    repairs: Count | None = None


class CallExpect(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What a call inside ``concurrent`` expects."""

    error: Text | None = None


class Mismatch(Exception):
    """A step whose outcome differs from the expectation."""

    def __init__(self, expected: str, actual: str, detail: str | None = None) -> None:
        super().__init__(detail or f"expected {expected}, got {actual}")
        self.expected, self.actual = expected, actual
        self.detail = detail or "not as expected"


Fail = Callable[[list[str | int], str], NoReturn]
"""``fail(path_below_the_action, problem)`` raises the located ScriptError."""


class Action:
    """One kind of step (see module rules); subclasses override what applies."""

    name: ClassVar[str]
    args: ClassVar[Any]
    expects: ClassVar[tuple[str, ...]] = ("error",)
    in_concurrent: ClassVar[bool] = False
    needs_isolator: ClassVar[bool] = True
    isolator_call: ClassVar[bool] = False

    def title(self, args: Any) -> str:
        """What a step does, in words (``prepare c1 (gpus:2)``)."""
        return self.name

    def calls(self, args: Any) -> int:
        """How many calls the step makes (counted against ``MAX_CALLS``)."""
        return 1

    def validate(self, args: Any, fail: Fail) -> None:
        """Load-time checks msgspec types cannot express."""

    def resolve(self, args: Any, base_dir: str | None) -> None:
        """Make paths in ``args`` relative to the script's directory absolute."""

    def call(self, run: "ScriptRunner", args: Any) -> Future:
        """One isolator call (actions allowed inside ``concurrent``)."""
        raise NotImplementedError(f"'{self.name}' is not an isolator call")

    async def perform(self, run: "ScriptRunner", args: Any, expect: Expect) -> Any:
        """Do the step; its outcome. Assertions raise ``Mismatch``."""
        return await self.call(run, args)

    async def check(self, run: "ScriptRunner", args: Any, expect: Expect, outcome: Any) -> None:
        """This action's own expectations (``error`` and ``result`` are the runner's)."""

    async def describe(self, run: "ScriptRunner", args: Any, outcome: Any) -> str:
        """The outcome, in words."""
        return "done"


ACTIONS: dict[str, Action] = {}
"""The registered actions by name, in registration order."""


def action(cls: type[Action]) -> type[Action]:
    """Register an action class (a class decorator)."""
    if cls.name in ACTIONS:
        raise ValueError(f"a script action named {cls.name!r} is registered already")
    unknown = [field for field in cls.expects if field not in Expect.__struct_fields__]
    if unknown:
        raise ValueError(f"action {cls.name!r} expects unknown expectations {unknown}")
    ACTIONS[cls.name] = cls()
    return cls


def concurrent_actions() -> tuple[str, ...]:
    """The actions allowed inside ``concurrent``, in registration order."""
    return tuple(name for name, a in ACTIONS.items() if a.in_concurrent)


def step_type(name: str, names: tuple[str, ...], expect: type, doc: str) -> type[msgspec.Struct]:
    """A step Struct: one optional field per action in ``names`` (of the
    action's ``args`` type), then ``expect`` and ``name``. Loading sets
    ``line``, ``where`` and ``action`` on each step (they are not fields)."""
    fields: list[tuple[str, Any, Any]] = [(n, ACTIONS[n].args | None, None) for n in names]
    fields += [("expect", expect, msgspec.field(default_factory=expect)), ("name", Text | None, None)]
    struct = msgspec.defstruct(name, fields, forbid_unknown_fields=True, kw_only=True, dict=True,
                               module=__name__.rsplit(".", 1)[0])
    struct.__doc__ = doc
    return struct


def error_text(error: BaseException | None) -> str:
    """A failure as the report shows it."""
    if error is None:
        return "unknown error"
    return str(error) or type(error).__name__


def wrong_error(action: Action, error: BaseException) -> str | None:
    """How ``error`` shows that a step of ``action`` failed with the wrong
    type (an isolator call's failure that is not an ``IsolatorError``); None
    when the type is right."""
    if action.isolator_call and not isinstance(error, IsolatorError):
        return f"{type(error).__name__} (not an IsolatorError): {error_text(error)}"
    return None


def short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
