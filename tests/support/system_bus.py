"""A private D-Bus bus for tests: the real ``dbus-daemon`` (Debian's ``dbus`` package), on a socket of the test's own.

Rules:
- ``dbus_skip_reason()`` says why no private bus can run here (no
  ``dbus-daemon``), None when one can; ``.ci/run`` installs ``dbus``.
- ``private_bus(directory)`` (a context manager) starts ``dbus-daemon
  --nofork`` with a system-bus-shaped configuration of its own (``<type>
  system``, EXTERNAL authentication, listening on
  ``<directory>/system_bus_socket``, a policy that lets every local
  user own names and send and receive everything), waits (bounded) for
  the address it prints, yields it, and kills the daemon on the way out.
  The host's bus is never touched.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_type="method_return"/>
    <allow send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="signal"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
  </policy>
</busconfig>
"""


def dbus_skip_reason() -> str | None:
    if shutil.which("dbus-daemon") is None:
        return "no dbus-daemon here (Debian's dbus package: apt-get install dbus)"
    return None


@contextmanager
def private_bus(directory: str, timeout: float = 20.0) -> Iterator[str]:
    """A private bus on ``<directory>/system_bus_socket``; its address (see module rules)."""
    socket = os.path.join(directory, "system_bus_socket")
    config = os.path.join(directory, "bus.conf")
    with open(config, "w") as handle:
        handle.write(_CONFIG.format(socket=socket))
    daemon = subprocess.Popen(["dbus-daemon", f"--config-file={config}", "--nofork", "--print-address=1"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert daemon.stdout is not None
        deadline = time.monotonic() + timeout
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or daemon.poll() is not None:
                raise AssertionError(f"dbus-daemon printed no address within {timeout}s (exit {daemon.poll()})")
            if select.select([daemon.stdout], [], [], left)[0]:
                chunk = os.read(daemon.stdout.fileno(), 4096)
                if not chunk:
                    continue
                line += chunk
        yield line.decode().strip()
    finally:
        daemon.kill()
        daemon.wait(timeout)
        if daemon.stdout is not None:
            daemon.stdout.close()
