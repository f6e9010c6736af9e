"""Errors of the NVML port and of host files.

Rules:
- Every NVML failure surfaces as ``NvmlError`` (a ``runtime.Failure``) whose
  message names the NVML function and NVML's own text, e.g.
  ``nvmlInit failed: Driver Not Loaded (NVML_ERROR_DRIVER_NOT_LOADED)``;
  ``.function`` and ``.code`` carry the raw facts.
- ``NvmlNotSupported`` is the "this GPU cannot tell" answer
  (``NVML_ERROR_NOT_SUPPORTED``); inventory readers turn it into "unknown",
  everything else propagates.
- ``NvmlUnavailable`` means there is no usable NVML at all (library missing,
  driver not loaded); the message says to pass a host file for a simulated
  node.
- ``HostFileError`` is one clear message per bad host file, naming the file
  and the field (``gpus[2].minor``); it is both a ``Failure`` and a
  ``ValueError``.
"""

from __future__ import annotations

from runtime import Failure

__all__ = [
    "NvmlError",
    "NvmlNotSupported",
    "NvmlUnavailable",
    "HostFileError",
    "NVML_SUCCESS",
    "NVML_ERROR_UNINITIALIZED",
    "NVML_ERROR_INVALID_ARGUMENT",
    "NVML_ERROR_NOT_SUPPORTED",
    "NVML_ERROR_NOT_FOUND",
    "NVML_ERROR_NO_PERMISSION",
    "NVML_ERROR_ARGUMENT_VERSION_MISMATCH",
    "NVML_ERROR_DRIVER_NOT_LOADED",
    "NVML_ERROR_TIMEOUT",
    "NVML_ERROR_LIBRARY_NOT_FOUND",
    "NVML_ERROR_FUNCTION_NOT_FOUND",
    "NVML_ERROR_GPU_IS_LOST",
    "NVML_ERROR_UNKNOWN",
    "nvml_error_name",
    "nvml_error_text",
]

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_UNKNOWN = 999

_NAMES = {
    NVML_ERROR_UNINITIALIZED: ("NVML_ERROR_UNINITIALIZED", "Uninitialized"),
    NVML_ERROR_INVALID_ARGUMENT: ("NVML_ERROR_INVALID_ARGUMENT", "Invalid Argument"),
    NVML_ERROR_NOT_SUPPORTED: ("NVML_ERROR_NOT_SUPPORTED", "Not Supported"),
    NVML_ERROR_NO_PERMISSION: ("NVML_ERROR_NO_PERMISSION", "Insufficient Permissions"),
    NVML_ERROR_NOT_FOUND: ("NVML_ERROR_NOT_FOUND", "Not Found"),
    NVML_ERROR_INSUFFICIENT_SIZE: ("NVML_ERROR_INSUFFICIENT_SIZE", "Insufficient Size"),
    NVML_ERROR_DRIVER_NOT_LOADED: ("NVML_ERROR_DRIVER_NOT_LOADED", "Driver Not Loaded"),
    NVML_ERROR_TIMEOUT: ("NVML_ERROR_TIMEOUT", "Timeout"),
    NVML_ERROR_LIBRARY_NOT_FOUND: ("NVML_ERROR_LIBRARY_NOT_FOUND", "NVML Shared Library Not Found"),
    NVML_ERROR_FUNCTION_NOT_FOUND: ("NVML_ERROR_FUNCTION_NOT_FOUND", "Function Not Found"),
    NVML_ERROR_GPU_IS_LOST: ("NVML_ERROR_GPU_IS_LOST", "GPU is lost"),
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH: (
        "NVML_ERROR_ARGUMENT_VERSION_MISMATCH",
        "Argument version mismatch",
    ),
    NVML_ERROR_UNKNOWN: ("NVML_ERROR_UNKNOWN", "Unknown Error"),
}


def nvml_error_name(code: int) -> str:
    """``NVML_ERROR_DRIVER_NOT_LOADED`` for 9; ``NVML_ERROR_<code>`` when unknown."""
    return _NAMES.get(code, (f"NVML_ERROR_{code}", ""))[0]


def nvml_error_text(code: int) -> str:
    """NVML's own text for ``code`` (``nvmlErrorString``)."""
    return _NAMES.get(code, ("", f"NVML Error with code {code}"))[1]


class NvmlError(Failure):
    """An NVML call failed; ``function`` and ``code`` say which and how."""

    def __init__(self, function: str, code: int, text: str | None = None, detail: str = "") -> None:
        self.function = function
        self.code = code
        self.text = text or nvml_error_text(code)
        self.detail = detail
        message = self.headline
        if detail:
            message += f"; {detail}"
        super().__init__(message)

    @property
    def headline(self) -> str:
        """The failure without the detail: ``nvmlInit failed: Driver Not Loaded (NVML_ERROR_DRIVER_NOT_LOADED)``."""
        return f"{self.function} failed: {self.text} ({nvml_error_name(self.code)})"

    def __reduce__(self):  # keep pickling (e.g. across processes) lossless
        return (type(self), (self.function, self.code, self.text, self.detail))

    @staticmethod
    def of(function: str, code: int, text: str | None = None, detail: str = "") -> "NvmlError":
        """The most specific NvmlError subclass for ``code``."""
        if code == NVML_ERROR_NOT_SUPPORTED:
            return NvmlNotSupported(function, code, text, detail)
        if code in (NVML_ERROR_DRIVER_NOT_LOADED, NVML_ERROR_LIBRARY_NOT_FOUND):
            return NvmlUnavailable(function, code, text, detail)
        return NvmlError(function, code, text, detail)


class NvmlNotSupported(NvmlError):
    """NVML_ERROR_NOT_SUPPORTED: the device cannot answer this question."""


class NvmlUnavailable(NvmlError):
    """No usable NVML: the library or the NVIDIA driver is absent."""

    def __init__(self, function: str, code: int, text: str | None = None, detail: str = "") -> None:
        if _HINT not in detail:
            detail = f"{detail}; {_HINT}" if detail else _HINT
        super().__init__(function, code, text, detail)


_HINT = (
    "is the NVIDIA driver installed and loaded? Without one, set '--host_file'"
    " (Flags.host_file) to a host file to use a simulated node"
)


class HostFileError(Failure, ValueError):
    """A host file is unreadable or invalid; the message names the file and field."""
