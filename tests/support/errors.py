"""How tests judge an isolator's failures (SPEC 11, issue 13).

Rules:
- Every failure of an isolator method is exactly an ``IsolatorError``
  (``InvalidContainerID`` for a bad id) with the message texts of the
  SPEC (Mesos' wording). A test asserts both: ``isinstance`` or
  ``pytest.raises(IsolatorError)`` would let a subclass through, a
  ``runtime.Failure`` anything at all.
- ``is_isolator_error(error, text)``: whether ``error`` is exactly an
  ``IsolatorError`` whose message is ``text`` (a string: equal; a compiled
  pattern: ``fullmatch``).
- ``assert_isolator_error(error, text)`` asserts it, showing the type and the
  message when it does not hold; ``raises_isolator_error(text)`` is the same
  around a block (``pytest.raises`` style: ``as caught``, ``caught.value``);
  ``isolator_failure(awaitable, text)`` awaits a call that must fail and
  returns the error.
- ``injected(operation, target, code)``: device control's text for a kernel
  operation a ``FaultInjectingBackend`` failed (the message an isolator
  error carries on from it).
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from isolators import IsolatorError

__all__ = ["assert_isolator_error", "injected", "is_isolator_error", "isolator_failure", "raises_isolator_error"]

def _text_matches(message: str, text: str | re.Pattern[str] | None) -> bool:
    if text is None:
        return True
    if isinstance(text, re.Pattern):
        return text.fullmatch(message) is not None
    return message == text


def is_isolator_error(error: BaseException | None, text: str | re.Pattern[str] | None = None,
                      kind: type[IsolatorError] = IsolatorError) -> bool:
    """Whether ``error`` is exactly a ``kind`` whose message is ``text`` (see the module rules)."""
    return type(error) is kind and _text_matches(str(error), text)


def assert_isolator_error(error: BaseException | None, text: str | re.Pattern[str] | None = None,
                          kind: type[IsolatorError] = IsolatorError) -> Any:
    """Assert ``is_isolator_error``; the error."""
    assert type(error) is kind, f"expected exactly {kind.__name__}, got {type(error).__name__}: {error}"
    shown = text.pattern if isinstance(text, re.Pattern) else text
    assert _text_matches(str(error), text), f"{kind.__name__} text {str(error)!r} is not {shown!r}"
    return error


@contextmanager
def raises_isolator_error(text: str | re.Pattern[str] | None = None,
                          kind: type[IsolatorError] = IsolatorError) -> Iterator[Any]:
    """``pytest.raises`` for exactly a ``kind`` with the message ``text``."""
    with pytest.raises(Exception) as caught:
        yield caught
    assert_isolator_error(caught.value, text, kind)


async def isolator_failure(call: Awaitable[Any], text: str | re.Pattern[str] | None = None,
                           kind: type[IsolatorError] = IsolatorError) -> Any:
    """Await ``call``, which must fail with exactly a ``kind`` with the message ``text``; the error."""
    with raises_isolator_error(text, kind) as caught:
        await call
    return caught.value


def injected(operation: str, target: str, code: int, number: int = 1) -> str:
    """Device control's text for a kernel operation that
    ``actors.devices.testing.FaultInjectingBackend`` failed with ``code``."""
    return (f"Failed to {operation} {target}: {os.strerror(code)} (injected at kernel operation #{number}:"
            f" {operation}) ({errno.errorcode[code]})")
