"""Soak: run the whole test suite again and again, to find the tests that fail by chance.

Usage (from a checkout, with the test extra installed)::

    python -m tests.soak --runs 10             # 10 full runs in a row
    python -m tests.soak --runs 5 --busy 1     # ... with one core kept busy by another process
    python -m tests.soak --runs 3 -- tests/devices -k worker   # pytest arguments after --

Rules:
- Each run is a fresh ``python -m pytest`` process (the README's test
  command) with a JUnit XML report of its own; the soak reads the report,
  not the terminal, so a failing test is named exactly (``file::test[param]``).
- ``--busy N`` starts N busy-loop processes, each pinned to one core
  (``sched_setaffinity``, the highest-numbered cores first), for the whole
  soak, and stops them at the end (also on Ctrl-C or a failure); nothing else
  of the machine is touched.
- ``--until-failure`` stops at the first run with a failure; otherwise every
  run is made. Per run the soak prints one line (index, counts, seconds,
  load average, failing tests); at the end one summary: runs, green runs,
  and each failing test with the number of runs it failed in. The exit
  status is 0 only if every run was green.
- A run that hangs past ``--timeout`` seconds is killed (its process group)
  and counted as failed, "timed out".
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import msgspec

__all__ = ["RunResult", "main", "run_suite"]


class RunResult(msgspec.Struct, frozen=True):
    """One full run of the suite."""

    index: int
    passed: int
    failed: list[str]
    """Test ids (``file::name``) that failed or errored."""
    skipped: int
    seconds: float
    load: str
    """``/proc/loadavg``'s three averages when the run ended."""
    returncode: int

    @property
    def green(self) -> bool:
        return self.returncode == 0 and not self.failed


def _load() -> str:
    try:
        with open("/proc/loadavg") as file:
            return " ".join(file.read().split()[:3])
    except OSError:
        return "?"


def _test_id(case: ElementTree.Element) -> str:
    """``path/to/test_file.py::Class::name`` from a report's dotted classname."""
    parts = case.get("classname", "").split(".")
    name = case.get("name", "")
    for cut in range(len(parts), 0, -1):  # the longest dotted prefix that is a file is the module
        module = "/".join(parts[:cut]) + ".py"
        if os.path.isfile(module):
            return "::".join([module, *parts[cut:], name])
    return "::".join([*filter(None, parts), name])


def read_report(path: str) -> tuple[int, list[str], int]:
    """(passed, failed ids, skipped) of a JUnit XML report."""
    tree = ElementTree.parse(path)
    passed, skipped, failed = 0, 0, []
    for case in tree.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(_test_id(case))
        elif case.find("skipped") is not None:
            skipped += 1
        else:
            passed += 1
    return passed, failed, skipped


def run_suite(index: int, pytest_args: Sequence[str], timeout: float, log_dir: str) -> RunResult:
    """One full ``python -m pytest`` run (see the module rules)."""
    report = os.path.join(log_dir, f"run-{index}.xml")
    log = os.path.join(log_dir, f"run-{index}.log")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *pytest_args]
    started = time.monotonic()
    with open(log, "wb") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = child.wait(timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            returncode = child.wait()
            timed_out = True
    seconds = time.monotonic() - started
    try:
        passed, failed, skipped = read_report(report)
    except (OSError, ElementTree.ParseError):
        passed, failed, skipped = 0, [], 0
    if timed_out:
        failed = [*failed, f"timed out after {timeout:g}s (log: {log})"]
    elif returncode != 0 and not failed:
        failed = [f"pytest exited {returncode} (log: {log})"]
    return RunResult(index, passed, failed, skipped, round(seconds, 1), _load(), returncode)


def _spin() -> None:  # pragma: no cover - runs in the busy processes
    while True:
        pass


@contextmanager
def busy_cores(count: int) -> Iterator[list[int]]:
    """``count`` busy-loop processes pinned one per core, stopped on exit."""
    cores = sorted(os.sched_getaffinity(0), reverse=True)[:count]
    pids: list[int] = []
    try:
        for core in cores:
            pid = os.fork()
            if pid == 0:  # the child: spin on its core until killed
                try:
                    os.sched_setaffinity(0, {core})
                    _spin()
                finally:
                    os._exit(0)
            pids.append(pid)
        yield cores
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="full runs to make (default 10)")
    parser.add_argument("--busy", type=int, default=0, metavar="N", help="keep N cores busy during the runs")
    parser.add_argument("--until-failure", action="store_true", help="stop at the first run with a failure")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds before a run counts as hung")
    parser.add_argument("--logs", default=None, help="directory for each run's log and report (default: a temp dir)")
    parser.add_argument("pytest_args", nargs="*", help="arguments for pytest (after --)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.busy < 0:
        parser.error("--runs must be >= 1 and --busy >= 0")
    log_dir = args.logs or tempfile.mkdtemp(prefix="gpu-isolator-soak-")
    os.makedirs(log_dir, exist_ok=True)
    results: list[RunResult] = []
    with busy_cores(args.busy) as cores:
        busy = f", cores {cores} kept busy" if cores else ""
        print(f"soak: {args.runs} run(s) of python -m pytest{busy}; logs in {log_dir}", flush=True)
        for index in range(1, args.runs + 1):
            result = run_suite(index, args.pytest_args, args.timeout, log_dir)
            results.append(result)
            state = "green" if result.green else f"{len(result.failed)} FAILED"
            print(f"run {index}: {state}: {result.passed} passed, {result.skipped} skipped in {result.seconds:g}s"
                  f" (load {result.load})", flush=True)
            for test in result.failed:
                print(f"    {test}", flush=True)
            if args.until_failure and not result.green:
                break
    failures = collections.Counter(test for result in results for test in result.failed)
    green = sum(result.green for result in results)
    print(f"soak: {green} of {len(results)} run(s) green")
    for test, count in failures.most_common():
        print(f"  failed in {count} run(s): {test}")
    print(msgspec.json.encode({"runs": len(results), "green": green, "busy_cores": args.busy,
                               "failures": dict(failures), "results": results}).decode())
    return 0 if green == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
