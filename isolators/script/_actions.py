"""The step actions of a message script, one class each (see ``_action``).

Rules of each action are in its class docstring: what its value holds, what
it does, what it can expect. Isolator calls (``prepare``, ``update``,
``usage``, ``cleanup``) may also stand inside ``concurrent``; they are
registered before it, since the steps inside ``concurrent`` are built from
the actions registered so far.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from actors.gpu import Gpu
from actors.manifest import ImageManifest
from actors.mig import MigDevice
from actors.resources import Resources
from runtime import Clock, Future, await_all

from .._errors import IsolatorError
from .._recovery import minors
from .._types import ContainerClass, ContainerConfig, ContainerID, ContainerState
from ._action import (
    ACTIONS,
    MAX_REPEAT,
    MAX_STEPS,
    RUNNER_FLAGS,
    Action,
    CallExpect,
    Expect,
    Fail,
    Id,
    MigText,
    Minor,
    Mismatch,
    Text,
    Unit,
    action,
    concurrent_actions,
    error_text,
    step_type,
    wrong_error,
)

if TYPE_CHECKING:
    from ._runner import ScriptRunner


class ById(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    id: Id


async def _held_text(run: "ScriptRunner", target: str) -> tuple[list[int] | None, str]:
    held = (await run.isolator.containers()).get(target)
    return held, (f"{target} holds GPUs {held}" if held is not None else f"{target} is not known")


def units_in_order(units: list[Any]) -> list[Any]:
    """Minors and MIG devices (``195:0/gi3/ci0``) in the order the isolator lists them."""
    return minors(Gpu.nvidia(u) if isinstance(u, int) else MigDevice.parse(u) for u in units)


async def _check_held(run: "ScriptRunner", target: str, expect: Expect) -> None:
    """``gpus`` / ``count``: what ``target`` holds after the step."""
    if expect.gpus is None and expect.count is None:
        return
    held, actual = await _held_text(run, target)
    if expect.gpus is not None and held != units_in_order(expect.gpus):
        raise Mismatch(f"{target} holds GPUs {units_in_order(expect.gpus)}", actual, "other GPUs than expected")
    if expect.count is not None and (held is None or len(held) != expect.count):
        raise Mismatch(f"{target} holds {expect.count} GPUs", actual, "another number of GPUs")


async def _describe_held(run: "ScriptRunner", target: str) -> str:
    held = (await run.isolator.containers()).get(target)
    return f"{target} holds GPUs {held}" if held is not None else f"{target} ready (nested: no GPUs of its own)"


def _relative_name(path: str) -> bool:
    return not (os.path.isabs(path) or not path.strip() or any(part in ("", ".", "..") for part in path.split("/")))


# -- isolator calls ------------------------------------------------------------------
class Prepare(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    id: Id
    resources: Text = ""
    rootfs: str | None = None
    docker_env: list[str] | None = None
    docker_labels: dict[str, str] | None = None
    debug: bool = False
    task: bool = False


@action
class PrepareAction(Action):
    """``prepare: {id, resources, rootfs, docker_env, docker_labels, debug, task}``:
    ``isolator.prepare``; ``rootfs`` is a relative name made inside the run's
    temp dir, a docker manifest is given by ``docker_env`` / ``docker_labels``.
    Expects ``gpus`` / ``count`` (held afterwards), ``none`` (no launch info)."""

    name = "prepare"
    isolator_call = True
    args = Prepare
    expects = ("error", "gpus", "count", "none", "result")
    in_concurrent = True

    def title(self, args: Prepare) -> str:
        extras = [args.resources or "no resources"]
        if args.rootfs:
            extras.append(f"rootfs {args.rootfs}")
        if args.debug:
            extras.append("DEBUG")
        return f"prepare {args.id} ({', '.join(extras)})"

    def validate(self, args: Prepare, fail: Fail) -> None:
        if args.rootfs is not None and not _relative_name(args.rootfs):
            fail(["rootfs"], f"rootfs {args.rootfs!r} must be a relative name (it is made inside the run's temp dir)")

    def call(self, run: "ScriptRunner", args: Prepare) -> Future:
        manifest = None
        if args.docker_env is not None or args.docker_labels is not None:
            manifest = ImageManifest(env=args.docker_env or [], labels=args.docker_labels or {})
        config = ContainerConfig(
            resources=Resources.parse(args.resources),
            rootfs=None if args.rootfs is None else os.path.join(run.rootfs_dir, args.rootfs),
            docker_manifest=manifest,
            container_class=ContainerClass.DEBUG if args.debug else ContainerClass.DEFAULT,
            has_task_info=args.task,
        )
        return run.isolator.prepare(ContainerID.parse(args.id), config)

    async def check(self, run: "ScriptRunner", args: Prepare, expect: Expect, outcome: Any) -> None:
        if expect.none is not None and (outcome is None) != expect.none:
            raise Mismatch("no launch info" if expect.none else "a launch info",
                           "a launch info" if outcome is not None else "no launch info")
        await _check_held(run, args.id, expect)

    async def describe(self, run: "ScriptRunner", args: Prepare, outcome: Any) -> str:
        text = await _describe_held(run, args.id)
        if outcome is not None:
            env = outcome.environment or outcome.task_environment
            mounts = len(outcome.mounts)
            text += f"; launch info: {mounts} mount{'s' if mounts != 1 else ''}" + (
                f", env {sorted(env)}" if env else "")
        return text


class Update(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    id: Id
    resources: Text


@action
class UpdateAction(Action):
    """``update: {id, resources}``: ``isolator.update``. Expects ``gpus`` / ``count``."""

    name = "update"
    isolator_call = True
    args = Update
    expects = ("error", "gpus", "count", "result")
    in_concurrent = True

    def title(self, args: Update) -> str:
        return f"update {args.id} to {args.resources}"

    def call(self, run: "ScriptRunner", args: Update) -> Future:
        return run.isolator.update(ContainerID.parse(args.id), Resources.parse(args.resources))

    async def check(self, run: "ScriptRunner", args: Update, expect: Expect, outcome: Any) -> None:
        await _check_held(run, args.id, expect)

    async def describe(self, run: "ScriptRunner", args: Update, outcome: Any) -> str:
        return await _describe_held(run, args.id)


class _ByIdCall(Action):
    """An isolator call of the action's name taking only a container id."""

    args = ById
    isolator_call = True
    expects = ("error", "result")
    in_concurrent = True

    def call(self, run: "ScriptRunner", args: ById) -> Future:
        return getattr(run.isolator, self.name)(ContainerID.parse(args.id))


@action
class UsageAction(_ByIdCall):
    """``usage: {id}``: ``isolator.usage``; reports the readings per GPU."""

    name = "usage"

    def title(self, args: ById) -> str:
        return f"usage of {args.id}"

    async def describe(self, run: "ScriptRunner", args: ById, outcome: Any) -> str:
        gpus = "; ".join(_gpu_usage(g) for g in outcome.gpus)
        n = outcome.gpus_allocated
        return f"{n} GPU{'s' if n != 1 else ''}" + (f": {gpus}" if gpus else "")


def _gpu_usage(g: Any) -> str:
    if g.gpu_instance_id is not None:  # a MIG device
        parts = [f"MIG device 195:{g.minor}/gi{g.gpu_instance_id}/ci{g.compute_instance_id} ({g.mig_profile})"]
    else:
        parts = [f"GPU {g.minor}"]
    if g.memory_total_bytes is not None:
        used = "?" if g.memory_used_bytes is None else g.memory_used_bytes // (1 << 20)
        parts.append(f"{used}/{g.memory_total_bytes // (1 << 20)} MiB")
    if g.utilization_gpu_percent is not None:
        parts.append(f"{g.utilization_gpu_percent}% busy")
    if g.power_milliwatts is not None:
        parts.append(f"{g.power_milliwatts / 1000:g} W")
    if g.temperature_celsius is not None:
        parts.append(f"{g.temperature_celsius} C")
    return " ".join(parts)


@action
class CleanupAction(_ByIdCall):
    """``cleanup: {id}``: ``isolator.cleanup``; reports the free GPUs after it."""

    name = "cleanup"

    def title(self, args: ById) -> str:
        return f"cleanup {args.id}"

    async def describe(self, run: "ScriptRunner", args: ById, outcome: Any) -> str:
        free = sorted(g.minor for g in await run.components.allocator.available())
        return f"{args.id} gone; free GPUs now {free}"


class Recover(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    states: list[Id] = []
    orphans: list[Id] = []


@action
class RecoverAction(Action):
    """``recover: {states, orphans}``: ``isolator.recover`` with those container ids."""

    name = "recover"
    isolator_call = True
    args = Recover

    def title(self, args: Recover) -> str:
        return f"recover states {args.states}" + (f", orphans {args.orphans}" if args.orphans else "")

    async def perform(self, run: "ScriptRunner", args: Recover, expect: Expect) -> Any:
        states = [ContainerState(ContainerID.parse(s)) for s in args.states]
        return await run.isolator.recover(states, {ContainerID.parse(o) for o in args.orphans})


# -- the agent -------------------------------------------------------------------------
@action
class CreateAction(Action):
    """``create: {flag: value, ...}``: drop the running isolator and build
    components and isolator from these flags, failing as the agent's start-up
    does (a ``host_file`` is relative to the script; the runner's own paths
    cannot be set). Later restarts keep these flags."""

    name = "create"
    args = dict[str, Any]
    needs_isolator = False

    def title(self, args: dict[str, Any]) -> str:
        flags = ", ".join(f"{k}={v}" for k, v in args.items())
        return f"create the isolator ({flags or 'default flags'})"

    def validate(self, args: dict[str, Any], fail: Fail) -> None:
        for key in args:
            name = str(key).replace("-", "_")
            if name in RUNNER_FLAGS and name != "host_file":
                fail([key], f"the flag '{key}' is set by the runner (each run gets its own)")

    def resolve(self, args: dict[str, Any], base_dir: str | None) -> None:
        if isinstance(args.get("host_file"), str):
            args["host_file"] = resolve_path(args["host_file"], base_dir)

    async def perform(self, run: "ScriptRunner", args: dict[str, Any], expect: Expect) -> Any:
        await run.node.stop()
        _components, isolator = await run.node.start(args)
        run.created = args
        await isolator.recover([], set())
        return None

    async def describe(self, run: "ScriptRunner", args: dict[str, Any], outcome: Any) -> str:
        return "isolator running"


def resolve_path(path: str, base_dir: str | None) -> str:
    """``path`` made absolute, relative to ``base_dir`` when given."""
    path = os.path.expanduser(path)
    if base_dir is not None and not os.path.isabs(path):
        path = os.path.join(base_dir, path)
    return os.path.abspath(path)


CallStep = step_type("CallStep", concurrent_actions(), CallExpect, "A step inside ``concurrent``: one isolator call.")


class Concurrent(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    steps: Annotated[list[CallStep], msgspec.Meta(min_length=1, max_length=MAX_STEPS)]  # type: ignore[valid-type]
    repeat: Annotated[int, msgspec.Meta(ge=1, le=MAX_REPEAT)] = 1


@action
class ConcurrentAction(Action):
    """``concurrent: {steps, repeat}``: every call dispatched at once,
    ``repeat`` times (``{i}`` in a call's text becomes the repetition's
    number), then awaited together. Each call may expect an ``error``;
    the group may expect counts (``ok`` / ``failed``): then failures of
    calls that expect none are counted, not reported."""

    name = "concurrent"
    args = Concurrent
    expects = ("ok", "failed")

    def title(self, args: Concurrent) -> str:
        calls = "; ".join(ACTIONS[sub.action].title(getattr(sub, sub.action)) for sub in args.steps)
        count = self.calls(args)
        return f"{count} call{'s' if count != 1 else ''} at once: {calls}" + (
            f" (x{args.repeat})" if args.repeat > 1 else "")

    def calls(self, args: Concurrent) -> int:
        return args.repeat * len(args.steps)

    async def perform(self, run: "ScriptRunner", args: Concurrent, expect: Expect) -> Any:
        calls = [(_substitute(sub, i), sub) for i in range(args.repeat) for sub in args.steps]
        settled = await await_all([_dispatch(run, concrete) for concrete, _sub in calls])
        ok = sum(1 for f in settled if f.is_ready())
        failed = len(settled) - ok
        summary = f"{ok} ok, {failed} failed"
        if expect.ok is not None and ok != expect.ok:
            raise Mismatch(f"{expect.ok} ok", summary, summary)
        if expect.failed is not None and failed != expect.failed:
            raise Mismatch(f"{expect.failed} failed", summary, summary)
        counted = expect.ok is not None or expect.failed is not None
        for f, (concrete, sub) in zip(settled, calls):
            wanted = sub.expect.error
            title = ACTIONS[sub.action].title(getattr(concrete, sub.action))
            if f.is_failed():
                text = error_text(f.failure())
                wrong = wrong_error(ACTIONS[sub.action], f.failure())
                if wrong is not None:
                    raise Mismatch(f"{title}: an IsolatorError", f"{title}: error: {wrong}",
                                   f"{title} failed with the wrong error type")
                if wanted is None and not counted:
                    raise Mismatch(f"{title}: success", f"{title}: error: {text}", summary)
                if wanted is not None and wanted.lower() not in text.lower():
                    raise Mismatch(f"{title}: an error containing {wanted!r}", f"{title}: error: {text}", summary)
            elif wanted is not None and not counted:
                raise Mismatch(f"{title}: an error containing {wanted!r}", f"{title}: success", summary)
        return {"ok": ok, "failed": failed}

    async def describe(self, run: "ScriptRunner", args: Concurrent, outcome: Any) -> str:
        return f"{outcome['ok']} ok, {outcome['failed']} failed"


def _substitute(step: Any, i: int) -> Any:
    """The call with ``{i}`` replaced by ``i`` in every text."""
    text = json.dumps(msgspec.to_builtins(step)).replace("{i}", str(i))
    concrete = msgspec.convert(json.loads(text), CallStep)
    concrete.action = step.action
    return concrete


def _dispatch(run: "ScriptRunner", step: Any) -> Future:
    try:
        return ACTIONS[step.action].call(run, getattr(step, step.action))
    except Exception as e:  # a bad id or resources: the call fails
        return Future.failed(e)


@action
class AdvanceAction(Action):
    """``advance: SECONDS``: pause the runtime clock (once), advance it, settle."""

    name = "advance"
    args = Annotated[float, msgspec.Meta(ge=0, le=1e9)]
    expects = ()
    needs_isolator = False

    def title(self, args: float) -> str:
        return f"advance the clock {args:g} s"

    async def perform(self, run: "ScriptRunner", args: float, expect: Expect) -> Any:
        if not Clock.paused():
            Clock.pause()
        Clock.advance(args)
        await Clock.settle()
        return None


class Restart(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    recover: bool = True
    states: list[Id] | None = None
    """The containers the agent still knows (default: every one the isolator held)."""
    orphans: list[Id] = []


@action
class RestartAction(Action):
    """``restart: {recover, states, orphans}``: an agent restart: drop every
    actor, rebuild from the flags, recover the containers the agent still
    knows from what the kernel holds. Its result is
    ``{recovered: [ids], report: [lines]}``."""

    name = "restart"
    args = Restart
    expects = ("error", "result")

    def title(self, args: Restart) -> str:
        return "agent restart: drop every actor, rebuild" + (", recover" if args.recover else "")

    async def perform(self, run: "ScriptRunner", args: Restart, expect: Expect) -> Any:
        _components, isolator = await run.node.restart(args.states, args.orphans, recover=args.recover,
                                                       changes=run.created)
        if not args.recover:
            return {"recovered": [], "report": []}
        return {"recovered": sorted((await isolator.containers()).keys()), "report": isolator.recovery_report}

    async def describe(self, run: "ScriptRunner", args: Restart, outcome: Any) -> str:
        text = f"recovered {outcome['recovered'] or 'no containers'}"
        if outcome["report"]:
            text += "; " + "; ".join(outcome["report"])
        return text


# -- assertions and operator calls -------------------------------------------------------
@action
class FreeAction(Action):
    """``free: [minors]``: assert the allocator's free (whole) GPUs."""

    name = "free"
    args = list[Minor]
    expects = ()

    def title(self, args: list[int]) -> str:
        return "free GPUs"

    async def perform(self, run: "ScriptRunner", args: list[int], expect: Expect) -> Any:
        free = sorted(g.minor for g in await run.components.allocator.available() if isinstance(g, Gpu))
        if free != sorted(args):
            raise Mismatch(f"free GPUs {sorted(args)}", f"free GPUs {free}", "the free GPUs differ")
        return free

    async def describe(self, run: "ScriptRunner", args: list[int], outcome: Any) -> str:
        return f"{outcome}"


@action
class HeldAction(Action):
    """``held: {container: [minors]}``: assert which GPUs (and MIG devices,
    ``195:0/gi3/ci0``) each container holds."""

    name = "held"
    args = dict[str, list[Unit]]
    expects = ()

    def title(self, args: dict[str, list[int]]) -> str:
        return "GPUs held per container"

    async def perform(self, run: "ScriptRunner", args: dict[str, list[int]], expect: Expect) -> Any:
        held = await run.isolator.containers()
        expected = {k: units_in_order(v) for k, v in args.items()}
        if held != expected:
            raise Mismatch(f"{expected}", f"{held}", "the containers hold other GPUs")
        return held

    async def describe(self, run: "ScriptRunner", args: dict[str, list[int]], outcome: Any) -> str:
        return f"{outcome}"


@action
class ReconcileAction(Action):
    """``reconcile: true``: ``isolator.reconcile``. Expects ``repairs`` (their number)."""

    name = "reconcile"
    isolator_call = True
    args = bool
    expects = ("error", "repairs", "result")

    def title(self, args: bool) -> str:
        return "reconcile device rules"

    async def perform(self, run: "ScriptRunner", args: bool, expect: Expect) -> Any:
        return await run.isolator.reconcile()

    async def check(self, run: "ScriptRunner", args: bool, expect: Expect, outcome: Any) -> None:
        if expect.repairs is not None and len(outcome) != expect.repairs:
            raise Mismatch(f"{expect.repairs} repairs", f"{len(outcome)} repairs: {[r.description for r in outcome]}",
                           "another number of repairs")

    async def describe(self, run: "ScriptRunner", args: bool, outcome: Any) -> str:
        return f"{len(outcome)} repairs" + (": " + "; ".join(r.description for r in outcome) if outcome else "")


@action
class MarkUnhealthyAction(Action):
    """``mark_unhealthy: MINOR``: the allocator stops handing out that GPU."""

    name = "mark_unhealthy"
    args = Minor

    def title(self, args: int) -> str:
        return f"mark GPU {args} unhealthy"

    async def perform(self, run: "ScriptRunner", args: int, expect: Expect) -> Any:
        await run.components.allocator.mark_unhealthy(gpu_by_minor(run, args))
        return None


@action
class MarkHealthyAction(Action):
    """``mark_healthy: MINOR``: the operator returns that GPU to the pool
    (``allocator.mark_healthy``, R-HE-4); it is handed out again once free."""

    name = "mark_healthy"
    args = Minor

    def title(self, args: int) -> str:
        return f"mark GPU {args} healthy"

    async def perform(self, run: "ScriptRunner", args: int, expect: Expect) -> Any:
        await run.components.allocator.mark_healthy(gpu_by_minor(run, args))
        return None


def gpu_by_minor(run: "ScriptRunner", minor: int) -> Any:
    """The node's GPU with that minor number (IsolatorError when there is none)."""
    for gpu in run.components.allocator.total():
        if gpu.minor == minor:
            return gpu
    raise IsolatorError(f"No GPU with minor {minor} on this node")


@action
class FreeMigAction(Action):
    """``free_mig: ["195:0/gi3/ci0", ...]``: assert the allocator's free MIG devices (R-MG-3)."""

    name = "free_mig"
    args = list[MigText]
    expects = ()

    def title(self, args: list[str]) -> str:
        return "free MIG devices"

    async def perform(self, run: "ScriptRunner", args: list[str], expect: Expect) -> Any:
        free = minors(u for u in await run.components.allocator.available() if isinstance(u, MigDevice))
        wanted = units_in_order(args)
        if free != wanted:
            raise Mismatch(f"free MIG devices {wanted}", f"free MIG devices {free}", "the free MIG devices differ")
        return free

    async def describe(self, run: "ScriptRunner", args: list[str], outcome: Any) -> str:
        return f"{outcome}"
