"""The bpf(2) syscall for cgroup device programs, through ctypes.

Rules:
- Only what cgroup v2 device control needs: load a
  ``BPF_PROG_TYPE_CGROUP_DEVICE`` program, attach / detach it on a cgroup
  directory fd (``BPF_CGROUP_DEVICE``), query the attached program ids, and
  open a program by id to read its name, tag and instructions. No
  compiler, no libbpf.
- Every call returns a value or raises ``OSError`` with the kernel's errno;
  a refused load carries the verifier's log in the message. A load the
  verifier broke off with EAGAIN (a signal pending, e.g. SIGSTOP/SIGCONT)
  is tried again, up to ``PROG_LOAD_ATTEMPTS`` times, as libbpf does.
- File descriptors returned are the caller's to close.
- A program's tag (``ProgInfo.tag``) is a hash of its instructions, so
  ``program_tags`` tells whether an attached program is the one a policy
  compiles to without reading it back.
- Syscall number: 321 on x86_64, 280 on aarch64 (the only ones supported).
- Kernel facts (SPEC section 6): mixing ``flags=0`` and ``BPF_F_ALLOW_MULTI``
  attaches on one cgroup fails with EPERM; attaching the same program twice
  with ALLOW_MULTI fails with EINVAL; ``BPF_F_REPLACE`` swaps one attached
  program for another in place; detaching what is not attached is ENOENT.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import platform
import struct
from typing import Any, Callable, NamedTuple

_SYSCALL_NUMBERS = {"x86_64": 321, "amd64": 321, "aarch64": 280, "arm64": 280}

BPF_PROG_LOAD = 5
BPF_PROG_ATTACH = 8
BPF_PROG_DETACH = 9
BPF_PROG_GET_FD_BY_ID = 13
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_PROG_QUERY = 16

BPF_PROG_TYPE_CGROUP_DEVICE = 15
BPF_CGROUP_DEVICE = 6

BPF_F_ALLOW_OVERRIDE = 1 << 0
BPF_F_ALLOW_MULTI = 1 << 1
BPF_F_REPLACE = 1 << 2
BPF_F_QUERY_EFFECTIVE = 1 << 0

BPF_OBJ_NAME_LEN = 16
_ATTR_SIZE = 144  # >= every field used; the kernel wants the rest zero
_INFO_SIZE = 232  # struct bpf_prog_info is longer on new kernels; it truncates
_INFO_NAME_OFFSET = 64
_INFO_XLATED_LEN = 20  # u32 xlated_prog_len
_INFO_XLATED_INSNS = 32  # u64 xlated_prog_insns (a user pointer)
_LOG_SIZE = 1 << 16

_libc = None


def _syscall():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        _libc = libc
    return _libc.syscall


_number: Any = None
"""bpf(2)'s number as a ctypes argument, once known (``bpf``)."""


def syscall_number() -> int:
    """bpf(2)'s number on this machine."""
    machine = platform.machine().lower()
    if machine not in _SYSCALL_NUMBERS:
        raise OSError(95, f"bpf(2) via ctypes is not supported on {machine} (only x86_64 and aarch64)")
    return _SYSCALL_NUMBERS[machine]


def bpf(cmd: int, attr: ctypes.Array) -> int:
    """Call bpf(cmd, attr, sizeof attr); raise ``OSError`` on failure."""
    global _number
    if _number is None:
        _number = ctypes.c_long(syscall_number())  # the machine does not change: looked up once
    result = _syscall()(_number, ctypes.c_long(cmd), ctypes.c_void_p(ctypes.addressof(attr)), ctypes.c_long(len(attr)))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def _attr() -> ctypes.Array:
    return ctypes.create_string_buffer(_ATTR_SIZE)


PROG_LOAD_ATTEMPTS = 5
"""Loads tried at most while the verifier answers EAGAIN (as libbpf does)."""


def _retrying(attempt: Callable[[Any], int], log: Any) -> int:
    """``attempt(log)``, again while the verifier answers EAGAIN: it stops
    when a signal is pending for the loading thread (a SIGSTOP/SIGCONT of
    the process), not because the program is wrong."""
    for _ in range(PROG_LOAD_ATTEMPTS - 1):
        try:
            return attempt(log)
        except OSError as error:
            if error.errno != errno.EAGAIN:
                raise
    return attempt(log)


def prog_load(insns: bytes, name: str, license: bytes = b"GPL") -> int:
    """Load a cgroup device program; return its fd. ``name`` at most 15 bytes."""
    code = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(license)
    raw_name = name.encode()[: BPF_OBJ_NAME_LEN - 1]

    def attempt(log: ctypes.Array | None) -> int:
        attr = _attr()
        struct.pack_into("<IIQQ", attr, 0, BPF_PROG_TYPE_CGROUP_DEVICE, len(insns) // 8,
                         ctypes.addressof(code), ctypes.addressof(lic))
        if log is not None:
            struct.pack_into("<IIQ", attr, 24, 1, len(log), ctypes.addressof(log))
        attr[48:48 + len(raw_name)] = raw_name
        struct.pack_into("<I", attr, 68, BPF_CGROUP_DEVICE)  # expected_attach_type
        return bpf(BPF_PROG_LOAD, attr)

    try:
        return _retrying(attempt, None)
    except OSError as error:
        if error.errno not in (errno.EACCES, errno.EINVAL):  # ask the verifier why
            raise
        log = ctypes.create_string_buffer(_LOG_SIZE)
        try:
            return _retrying(attempt, log)
        except OSError as again:
            text = log.value.decode(errors="replace").strip()
            raise OSError(again.errno, f"{again.strerror}; verifier log: {text[-2000:]}") from None


def prog_attach(cgroup_fd: int, prog_fd: int, flags: int = BPF_F_ALLOW_MULTI, replace_fd: int = 0) -> None:
    """Attach ``prog_fd`` to the cgroup (``BPF_F_REPLACE`` with ``replace_fd`` swaps one)."""
    attr = _attr()
    struct.pack_into("<IIIII", attr, 0, cgroup_fd, prog_fd, BPF_CGROUP_DEVICE, flags, replace_fd)
    bpf(BPF_PROG_ATTACH, attr)


def prog_detach(cgroup_fd: int, prog_fd: int) -> None:
    """Detach ``prog_fd`` from the cgroup."""
    attr = _attr()
    struct.pack_into("<III", attr, 0, cgroup_fd, prog_fd, BPF_CGROUP_DEVICE)
    bpf(BPF_PROG_DETACH, attr)


def prog_query(cgroup_fd: int, effective: bool = False) -> tuple[int, list[int]]:
    """``(attach_flags, prog_ids)`` of the device programs attached directly to the cgroup; ``effective``:
    every program the kernel runs for it, its ancestors' included (``BPF_F_QUERY_EFFECTIVE``)."""
    capacity = 16
    while True:
        ids = (ctypes.c_uint32 * capacity)()
        attr = _attr()
        struct.pack_into("<IIIIQI", attr, 0, cgroup_fd, BPF_CGROUP_DEVICE, BPF_F_QUERY_EFFECTIVE if effective else 0,
                         0, ctypes.addressof(ids), capacity)
        try:
            bpf(BPF_PROG_QUERY, attr)
        except OSError as error:
            if error.errno == 28:  # ENOSPC: more programs than room
                capacity = struct.unpack_from("<I", attr, 24)[0] + 16
                continue
            raise
        flags, count = struct.unpack_from("<I", attr, 12)[0], struct.unpack_from("<I", attr, 24)[0]
        return flags, list(ids[:count])


def prog_get_fd_by_id(prog_id: int) -> int:
    """Open the program with id ``prog_id``; return its fd."""
    attr = _attr()
    struct.pack_into("<I", attr, 0, prog_id)
    return bpf(BPF_PROG_GET_FD_BY_ID, attr)


class ProgInfo(NamedTuple):
    """What device control reads about a loaded program."""

    id: int
    type: int
    name: str
    tag: bytes
    xlated_len: int = 0
    """Bytes of its instructions as the kernel holds them (``prog_xlated``)."""


def prog_info(prog_fd: int) -> ProgInfo:
    """The id, type, name, tag and instruction length of a program."""
    info = ctypes.create_string_buffer(_INFO_SIZE)
    attr = _attr()
    struct.pack_into("<IIQ", attr, 0, prog_fd, _INFO_SIZE, ctypes.addressof(info))
    bpf(BPF_OBJ_GET_INFO_BY_FD, attr)
    prog_type, prog_id = struct.unpack_from("<II", info, 0)
    raw = info.raw[_INFO_NAME_OFFSET:_INFO_NAME_OFFSET + BPF_OBJ_NAME_LEN]
    name = raw.split(b"\0", 1)[0].decode(errors="replace")
    xlated_len = struct.unpack_from("<I", info, _INFO_XLATED_LEN)[0]
    return ProgInfo(prog_id, prog_type, name, info.raw[8:16], xlated_len)


def prog_xlated(prog_fd: int, size: int) -> bytes:
    """The program's instructions as the kernel holds them (translated by the
    verifier), at most ``size`` bytes (``ProgInfo.xlated_len``). Needs
    CAP_SYS_ADMIN (else the kernel reports none: empty bytes)."""
    buffer = ctypes.create_string_buffer(max(size, 1))
    info = ctypes.create_string_buffer(_INFO_SIZE)
    struct.pack_into("<I", info, _INFO_XLATED_LEN, size)
    struct.pack_into("<Q", info, _INFO_XLATED_INSNS, ctypes.addressof(buffer))
    attr = _attr()
    struct.pack_into("<IIQ", attr, 0, prog_fd, _INFO_SIZE, ctypes.addressof(info))
    bpf(BPF_OBJ_GET_INFO_BY_FD, attr)
    length = struct.unpack_from("<I", info, _INFO_XLATED_LEN)[0]
    return buffer.raw[: min(size, length)]


def program_tags(insns: bytes) -> frozenset[bytes]:
    """The tags the kernel may give a program of ``insns``: the first 8 bytes
    of its SHA-256 (Linux 6.18+) or SHA-1 (before)."""
    return frozenset({hashlib.sha256(insns).digest()[:8], hashlib.sha1(insns).digest()[:8]})
