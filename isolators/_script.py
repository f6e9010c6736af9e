"""Message scripts: whole isolator scenarios as data (R-MS-1).

Rules:
- A script is YAML or JSON decoded by msgspec into typed steps; a wrong key,
  type or missing field is one error naming the path to the field
  (``$.steps[2].prepare.resources``) and the script's line.
- ``node`` names the simulated GPUs (``gpus: 4``, a list of GPU tables, or a
  ``host_file``), the device ``backend`` and extra ``flags``.
- Each step holds exactly one action: ``prepare``, ``update``, ``usage``,
  ``cleanup``, ``recover``, ``create`` (build components and isolator from
  flags; fails like the agent's start-up), ``concurrent`` (steps run at
  once, optionally ``repeat``-ed with ``{i}`` in ids), ``advance`` (paused
  clock seconds), ``restart`` (drop every actor, rebuild from flags, recover
  the containers the kernel / checkpoint still holds), ``free`` (assert the
  allocator's free minors), ``held`` (assert which minors each container
  holds), ``reconcile`` (expect a number of repairs) or ``mark_unhealthy``.
- Expectations: ``error`` (a substring the failure must contain), ``gpus``
  (minors the container holds after the step), ``result`` (fields of the
  returned value), ``ok``/``failed`` counts for a concurrent group. A step
  without ``error`` expects success.
- The runner drives the isolator actor through its handle (dispatch), reports
  every step with its line, and stops at the end with a summary; it never
  stops early, so one run shows every broken expectation.
- Kernel backends get a cgroups root of their own, removed at the end.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from typing import Any, Callable

import msgspec
import yaml

from actors import Flags, Resources

from runtime import Clock, Future, await_all

from ._components import NvidiaComponents
from ._errors import IsolatorError
from ._isolator import MesosIsolator, NvidiaGpuIsolatorProcess
from actors import ImageManifest

from ._types import ContainerClass, ContainerConfig, ContainerID, ContainerState

logger = logging.getLogger(__name__)

MAX_SCRIPT_BYTES = 1 << 20
MAX_STEPS = 10_000
MAX_REPEAT = 10_000


class ScriptError(IsolatorError, ValueError):
    """A script that cannot be read or decoded; the message names the field."""


# -- the format ---------------------------------------------------------------
class Node(msgspec.Struct, forbid_unknown_fields=True):
    gpus: int | list[dict[str, Any]] | None = None
    host_file: str | None = None
    driver_version: str = "550.54.15"
    backend: str = "memory"
    flags: dict[str, Any] = {}


class Prepare(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    resources: str = ""
    rootfs: str | None = None
    docker_env: list[str] | None = None
    docker_labels: dict[str, str] | None = None
    debug: bool = False
    task: bool = False


class Update(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    resources: str


class ById(msgspec.Struct, forbid_unknown_fields=True):
    id: str


class Recover(msgspec.Struct, forbid_unknown_fields=True):
    states: list[str] = []
    orphans: list[str] = []


class Restart(msgspec.Struct, forbid_unknown_fields=True):
    recover: bool = True


class Concurrent(msgspec.Struct, forbid_unknown_fields=True):
    steps: list["Step"] = []
    repeat: int = 1


class Expect(msgspec.Struct, forbid_unknown_fields=True):
    error: str | None = None
    gpus: list[int] | None = None
    count: int | None = None
    result: dict[str, Any] | None = None
    ok: int | None = None
    failed: int | None = None
    repairs: int | None = None
    none: bool | None = None


class Step(msgspec.Struct, forbid_unknown_fields=True):
    prepare: Prepare | None = None
    update: Update | None = None
    usage: ById | None = None
    cleanup: ById | None = None
    recover: Recover | None = None
    create: dict[str, Any] | None = None
    concurrent: Concurrent | None = None
    advance: float | None = None
    restart: Restart | None = None
    free: list[int] | None = None
    held: dict[str, list[int]] | None = None
    reconcile: bool | None = None
    mark_unhealthy: int | None = None
    expect: Expect = msgspec.field(default_factory=Expect)
    name: str | None = None
    line: int = 0

    def action(self) -> str:
        actions = [f for f in _ACTIONS if getattr(self, f) is not None]
        if len(actions) != 1:
            raise ScriptError(
                f"line {self.line}: a step needs exactly one action of {', '.join(_ACTIONS)};"
                f" got {', '.join(actions) or 'none'}"
            )
        return actions[0]


_ACTIONS = ("prepare", "update", "usage", "cleanup", "recover", "create", "concurrent", "advance",
            "restart", "free", "held", "reconcile", "mark_unhealthy")


class Script(msgspec.Struct, forbid_unknown_fields=True):
    name: str = "script"
    description: str = ""
    node: Node = msgspec.field(default_factory=Node)
    steps: list[Step] = []


# -- loading ------------------------------------------------------------------
class _LineLoader(yaml.SafeLoader):
    """A YAML loader that records each mapping's first line as ``line``."""


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> dict:
    mapping = loader.construct_mapping(node, deep=True)
    keys = {k.value for k, _ in node.value if isinstance(k, yaml.ScalarNode)}
    if keys & set(_ACTIONS) and "line" not in mapping:
        mapping["line"] = node.start_mark.line + 1
    return mapping


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _check_depth(value: Any, depth: int = 0) -> None:
    if depth > 32:
        raise ScriptError("The script is nested more than 32 levels deep")
    if isinstance(value, dict):
        for v in value.values():
            _check_depth(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_depth(v, depth + 1)


def load_script(text: str | bytes, source: str = "<script>") -> Script:
    """Decode a YAML or JSON script; raises ScriptError naming the bad field."""
    if len(text) > MAX_SCRIPT_BYTES:
        raise ScriptError(f"{source}: the script is {len(text)} bytes; the limit is {MAX_SCRIPT_BYTES}")
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    try:
        document = yaml.load(text, Loader=_LineLoader)  # JSON is YAML too
    except yaml.YAMLError as e:
        raise ScriptError(f"{source}: not valid YAML/JSON: {e}") from None
    except RecursionError:
        raise ScriptError(f"{source}: the script is nested too deeply") from None
    if not isinstance(document, dict):
        raise ScriptError(f"{source}: a script is a mapping with 'node' and 'steps', got {type(document).__name__}")
    _check_depth(document)
    try:
        script = msgspec.convert(document, Script)
    except msgspec.ValidationError as e:
        raise ScriptError(f"{source}: {e}") from None
    count = [0]

    def check(steps: list[Step]) -> None:
        for step in steps:
            count[0] += 1
            step.action()
            if step.concurrent is not None:
                if not 1 <= step.concurrent.repeat <= MAX_REPEAT:
                    raise ScriptError(f"{source}: line {step.line}: repeat must be 1..{MAX_REPEAT}")
                check(step.concurrent.steps)
    check(script.steps)
    if count[0] > MAX_STEPS:
        raise ScriptError(f"{source}: the script has {count[0]} steps; the limit is {MAX_STEPS}")
    return script


def load_script_file(path: str) -> Script:
    try:
        size = os.path.getsize(path)
        if size > MAX_SCRIPT_BYTES:
            raise ScriptError(f"{path}: the script is {size} bytes; the limit is {MAX_SCRIPT_BYTES}")
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ScriptError(f"Cannot read script '{path}': {e.strerror}") from None
    return load_script(data, path)


# -- running ------------------------------------------------------------------
class StepResult(msgspec.Struct):
    line: int
    action: str
    ok: bool
    detail: str


class ScriptReport(msgspec.Struct):
    name: str
    backend: str
    results: list[StepResult] = []

    @property
    def passed(self) -> bool:
        return all(r.ok for r in self.results)

    def summary(self) -> str:
        good = sum(r.ok for r in self.results)
        return f"{good} passed, {len(self.results) - good} failed"


class _Env:
    """The node a script runs on: flags, temp dirs, the live actors."""

    def __init__(self, script: Script, backend: str | None) -> None:
        self.script = script
        self.backend = backend or script.node.backend
        self.tmp = tempfile.mkdtemp(prefix="gpu-isolator-script-")
        node = script.node
        host_file = node.host_file
        if host_file is None:
            host = {"driver_version": node.driver_version}
            if isinstance(node.gpus, list):
                host["gpus"] = node.gpus
            else:
                host["gpu_count"] = 8 if node.gpus is None else node.gpus
            host_file = os.path.join(self.tmp, "host.json")
            with open(host_file, "w") as f:
                json.dump(host, f)
        os.makedirs(os.path.join(self.tmp, "dev"))
        base = dict(
            host_file=host_file,
            dev_dir=os.path.join(self.tmp, "dev"),
            runtime_dir=os.path.join(self.tmp, "run"),
            work_dir=os.path.join(self.tmp, "work"),
            volume_dir=os.path.join(self.tmp, "volume"),
            device_backend=self.backend,
            cgroups_root=f"gpu-isolator-script-{uuid.uuid4().hex[:12]}",
        )
        base.update(node.flags)
        self.base_flags = base
        self.flags = Flags(**base)
        self.components: NvidiaComponents | None = None
        self.isolator: MesosIsolator | None = None
        self.prepared: list[str] = []

    async def start(self, extra: dict[str, Any] | None = None) -> None:
        flags = self.flags if not extra else Flags(**{**self.base_flags, **extra})
        components = await NvidiaComponents.create(flags)
        try:
            isolator = await NvidiaGpuIsolatorProcess.create(flags, components)
        except BaseException:
            await components.close()
            raise
        self.flags, self.components, self.isolator = flags, components, isolator

    async def stop(self) -> None:
        if self.isolator is not None:
            await self.isolator.close()
        if self.components is not None:
            await self.components.close()
        self.isolator = self.components = None

    async def teardown(self) -> None:
        try:
            if self.isolator is None and self.backend != "memory":
                try:
                    await self.start()
                except Exception:
                    pass
            if self.isolator is not None:
                for cid in list((await self.isolator.containers()).keys()):
                    try:
                        await self.isolator.cleanup(ContainerID.parse(cid))
                    except Exception as e:
                        logger.warning("script teardown: cleanup of %s failed: %s", cid, e)
                await self.isolator.devices.remove_root()
        finally:
            await self.stop()
            shutil.rmtree(self.tmp, ignore_errors=True)


def _config(p: Prepare) -> ContainerConfig:
    manifest = None
    if p.docker_env is not None or p.docker_labels is not None:
        manifest = ImageManifest(env=p.docker_env or [], labels=p.docker_labels or {})
    return ContainerConfig(
        resources=Resources.parse(p.resources),
        rootfs=p.rootfs,
        docker_manifest=manifest,
        container_class=ContainerClass.DEBUG if p.debug else ContainerClass.DEFAULT,
        has_task_info=p.task,
    )


def _cid(text: str) -> ContainerID:
    return ContainerID.parse(text)


def _subset(expected: Any, actual: Any, path: str = "result") -> str | None:
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return f"{path}: expected a mapping, got {actual!r}"
        for k, v in expected.items():
            if k not in actual:
                return f"{path}.{k}: missing (got keys {sorted(actual)})"
            problem = _subset(v, actual[k], f"{path}.{k}")
            if problem:
                return problem
        return None
    if expected != actual:
        return f"{path}: expected {expected!r}, got {actual!r}"
    return None


class ScriptRunner:
    """Runs one script on one backend and reports every step."""

    def __init__(self, script: Script, backend: str | None = None,
                 echo: Callable[[str], None] | None = None) -> None:
        self.script = script
        self.env = _Env(script, backend)
        self.report = ScriptReport(script.name, self.env.backend)
        self.echo = echo or (lambda line: None)

    async def run(self) -> ScriptReport:
        env = self.env
        try:
            if not any(s.create is not None for s in self.script.steps[:1]):
                await env.start()
                await env.isolator.recover([], set())
            for step in self.script.steps:
                await self._run_step(step)
        finally:
            if Clock.paused():
                Clock.resume()
            await env.teardown()
        self.echo(f"{self.report.name} [{self.report.backend}]: {self.report.summary()}")
        return self.report

    def _record(self, step: Step, action: str, ok: bool, detail: str) -> None:
        label = step.name or action
        self.report.results.append(StepResult(step.line, action, ok, detail))
        mark = "ok  " if ok else "FAIL"
        self.echo(f"  {mark} line {step.line:<4} {label}: {detail}")

    async def _run_step(self, step: Step) -> None:
        action = step.action()
        try:
            outcome = await self._perform(step, action)
        except _Mismatch as e:
            self._record(step, action, False, str(e))
            return
        except Exception as e:  # a failed call: compare with the expected error
            self._check_error(step, action, e)
            return
        if step.expect.error is not None:
            self._record(step, action, False, f"expected an error containing {step.expect.error!r}, but it succeeded")
            return
        problem = await self._check_value(step, action, outcome)
        self._record(step, action, problem is None, problem or await self._describe(action, step, outcome))

    def _check_error(self, step: Step, action: str, error: BaseException) -> None:
        text = str(error) or type(error).__name__
        wanted = step.expect.error
        if wanted is None:
            self._record(step, action, False, f"expected success, got error: {text}")
        elif wanted.lower() in text.lower():
            self._record(step, action, True, f"failed as expected: {text}")
        else:
            self._record(step, action, False, f"expected an error containing {wanted!r}, got: {text}")

    async def _describe(self, action: str, step: Step, outcome: Any) -> str:
        target = step.prepare or step.update
        if target is not None and self.env.isolator is not None:
            held = (await self.env.isolator.containers()).get(target.id)
            text = f"{target.id} holds GPUs {held}" if held is not None else f"{target.id} ready"
            if outcome is not None:
                text += f"; launch info with {len(outcome.mounts)} mounts"
            return text
        if action == "usage":
            gpus = ", ".join(
                f"{g.minor}: {_mib(g.memory_used_bytes)}/{_mib(g.memory_total_bytes)} MiB, {g.utilization_gpu_percent}% busy"
                for g in outcome.gpus
            )
            return f"{outcome.gpus_allocated} GPUs" + (f" ({gpus})" if gpus else "")
        if outcome is None:
            return "done"
        if isinstance(outcome, (list, dict, int, float, str)):
            return f"{outcome}"
        return json.dumps(msgspec.to_builtins(outcome), sort_keys=True)[:200]

    async def _check_value(self, step: Step, action: str, outcome: Any) -> str | None:
        expect = step.expect
        if expect.none is not None and (outcome is None) != expect.none:
            return f"expected {'no' if expect.none else 'a'} launch info, got {outcome!r}"
        if expect.result is not None:
            problem = _subset(expect.result, msgspec.to_builtins(outcome) if outcome is not None else None)
            if problem:
                return problem
        if expect.gpus is not None or expect.count is not None:
            target = (step.prepare or step.update)
            if target is None:
                return "'gpus'/'count' expectations apply to prepare and update steps"
            held = (await self.env.isolator.containers()).get(target.id)
            if held is None:
                return f"container {target.id} is not known after the step"
            if expect.gpus is not None and held != sorted(expect.gpus):
                return f"expected container {target.id} to hold GPUs {sorted(expect.gpus)}, it holds {held}"
            if expect.count is not None and len(held) != expect.count:
                return f"expected container {target.id} to hold {expect.count} GPUs, it holds {held}"
        if expect.repairs is not None and len(outcome) != expect.repairs:
            return f"expected {expect.repairs} repairs, got {outcome}"
        return None

    async def _perform(self, step: Step, action: str) -> Any:
        env = self.env
        iso = env.isolator
        if action != "create" and iso is None and action not in ("advance",):
            raise IsolatorError("No isolator is running: an earlier 'create' step failed")
        if action == "prepare":
            p = step.prepare
            result = await iso.prepare(_cid(p.id), _config(p))
            return result
        if action == "update":
            return await iso.update(_cid(step.update.id), Resources.parse(step.update.resources))
        if action == "usage":
            return await iso.usage(_cid(step.usage.id))
        if action == "cleanup":
            return await iso.cleanup(_cid(step.cleanup.id))
        if action == "recover":
            states = [ContainerState(_cid(s)) for s in step.recover.states]
            return await iso.recover(states, {_cid(o) for o in step.recover.orphans})
        if action == "create":
            await env.stop()
            await env.start(step.create)
            await env.isolator.recover([], set())
            return None
        if action == "concurrent":
            return await self._concurrent(step)
        if action == "advance":
            if not Clock.paused():
                Clock.pause()
            Clock.advance(step.advance)
            return None
        if action == "restart":
            held = list((await iso.containers()).keys())
            await env.stop()
            await env.start()
            if step.restart.recover:
                await env.isolator.recover([ContainerState(_cid(c)) for c in held], set())
            return {"recovered": sorted(held)}
        if action == "free":
            free = sorted(g.minor for g in await env.components.allocator.available())
            if free != sorted(step.free):
                raise _Mismatch(f"expected free GPUs {sorted(step.free)}, the allocator has {free}")
            return free
        if action == "held":
            held = await iso.containers()
            expected = {k: sorted(v) for k, v in step.held.items()}
            if held != expected:
                raise _Mismatch(f"expected containers {expected}, the isolator holds {held}")
            return held
        if action == "reconcile":
            return await iso.reconcile()
        if action == "mark_unhealthy":
            await env.components.allocator.mark_unhealthy(_gpu_by_minor(env, step.mark_unhealthy))
            return None
        raise ScriptError(f"line {step.line}: unknown action {action!r}")

    async def _concurrent(self, step: Step) -> dict[str, int]:
        group = step.concurrent
        futures: list[Future] = []
        for i in range(group.repeat):
            for sub in group.steps:
                concrete = _substitute(sub, i)
                futures.append(self._dispatch_only(concrete, concrete.action()))
        settled = await await_all(futures)
        ok = sum(1 for f in settled if f.is_ready())
        failed = len(settled) - ok
        expect = step.expect
        if expect.ok is not None and ok != expect.ok:
            raise _Mismatch(f"expected {expect.ok} successes, got {ok} (and {failed} failures)")
        if expect.failed is not None and failed != expect.failed:
            raise _Mismatch(f"expected {expect.failed} failures, got {failed} (and {ok} successes)")
        for f, sub in zip(settled, [s for _ in range(group.repeat) for s in group.steps]):
            if sub.expect.error is not None and f.is_failed() and sub.expect.error.lower() not in str(f.failure()).lower():
                raise _Mismatch(f"a concurrent step failed with {f.failure()}, expected {sub.expect.error!r}")
        return {"ok": ok, "failed": failed}

    def _dispatch_only(self, step: Step, action: str) -> Future:
        iso = self.env.isolator
        try:
            if action == "prepare":
                return iso.prepare(_cid(step.prepare.id), _config(step.prepare))
            if action == "update":
                return iso.update(_cid(step.update.id), Resources.parse(step.update.resources))
            if action == "usage":
                return iso.usage(_cid(step.usage.id))
            if action == "cleanup":
                return iso.cleanup(_cid(step.cleanup.id))
        except Exception as e:
            return Future.failed(e)
        return Future.failed(ScriptError(f"line {step.line}: '{action}' cannot run inside 'concurrent'"))


class _Mismatch(Exception):
    """An assertion step whose state differs from the expectation."""


def _mib(value: int | None) -> str:
    return "?" if value is None else str(value // (1024 * 1024))


def _substitute(step: Step, i: int) -> Step:
    data = msgspec.to_builtins(step)
    text = json.dumps(data).replace("{i}", str(i))
    return msgspec.convert(json.loads(text), Step)


def _gpu_by_minor(env: _Env, minor: int) -> Any:
    for gpu in env.components.allocator.total():
        if gpu.minor == minor:
            return gpu
    raise ScriptError(f"No GPU with minor {minor} on this node")


async def run_script(script: Script, backend: str | None = None,
                     echo: Callable[[str], None] | None = None) -> ScriptReport:
    """Run ``script`` (inside a running ``runtime.Runtime``) and report."""
    return await ScriptRunner(script, backend, echo).run()
