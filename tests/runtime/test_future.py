"""R-RT-5: Future / Promise -- states, then, recover, after, discard, on_*,
collect, await_all. Pure parts are plain tests; awaiting and the Clock-driven
``after`` run on both backends."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from runtime import Clock, Discarded, Failure, Future, Promise, Runtime, await_all, collect


# -- states -------------------------------------------------------------------
def test_a_promise_completes_its_future_once() -> None:
    promise: Promise[int] = Promise()
    future = promise.future
    assert future.state == "pending" and future.is_pending()
    assert promise.set_value(1) is True
    assert future.state == "ready" and future.is_ready() and future.get() == 1
    assert promise.set_value(2) is False
    assert promise.fail(OSError("late")) is False
    assert promise.discard() is False
    assert future.get() == 1


def test_failed_and_discarded_states() -> None:
    failed: Promise[int] = Promise()
    error = OSError("nvml unavailable")
    failed.fail(error)
    assert failed.future.state == "failed" and failed.future.is_failed()
    assert failed.future.failure() is error
    with pytest.raises(OSError, match="nvml unavailable"):
        failed.future.get()

    discarded: Promise[int] = Promise()
    discarded.discard()
    assert discarded.future.state == "discarded" and discarded.future.is_discarded()
    with pytest.raises(Discarded, match="discarded"):
        discarded.future.get()


def test_fail_with_text_becomes_a_failure() -> None:
    promise: Promise[int] = Promise()
    promise.fail("no GPUs left")
    assert isinstance(promise.future.failure(), Failure)
    assert str(promise.future.failure()) == "no GPUs left"
    assert str(Future.failed("gone").failure()) == "gone"


def test_get_on_a_pending_future_says_to_await_it() -> None:
    with pytest.raises(RuntimeError, match="still pending: await it"):
        Future().get()


def test_ready_and_failed_constructors() -> None:
    assert Future.ready(3).get() == 3
    assert Future.failed(KeyError("k")).is_failed()


# -- callbacks ----------------------------------------------------------------
def test_callbacks_run_in_registration_order_and_at_once_when_completed() -> None:
    calls: list[Any] = []
    promise: Promise[int] = Promise()
    future = promise.future
    future.on_any(lambda f: calls.append(("any", f.state)))
    future.on_ready(lambda v: calls.append(("ready", v)))
    future.on_failed(lambda e: calls.append(("failed", e)))
    future.on_discarded(lambda: calls.append("discarded"))
    assert calls == []
    promise.set_value(5)
    assert calls == [("any", "ready"), ("ready", 5)]
    future.on_ready(lambda v: calls.append(("late", v)))
    assert calls[-1] == ("late", 5)


def test_on_failed_and_on_discarded_fire_for_their_state_only() -> None:
    calls: list[Any] = []
    failed: Promise[int] = Promise()
    error = ValueError("x")
    failed.future.on_ready(lambda v: calls.append("ready")).on_failed(lambda e: calls.append(e))
    failed.fail(error)
    discarded: Promise[int] = Promise()
    discarded.future.on_discarded(lambda: calls.append("discarded")).on_failed(lambda e: calls.append("failed"))
    discarded.discard()
    assert calls == [error, "discarded"]


def test_a_raising_callback_is_logged_and_never_breaks_the_completer(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []
    promise: Promise[int] = Promise()

    def bad(_value: int) -> None:
        raise RuntimeError("callback bug")

    promise.future.on_ready(bad)
    promise.future.on_ready(lambda v: calls.append("second"))
    with caplog.at_level(logging.ERROR, logger="runtime._future"):
        assert promise.set_value(1) is True
    assert calls == ["second"]
    assert "Future callback" in caplog.text and "callback bug" in caplog.text


# -- then / recover -----------------------------------------------------------
def test_then_maps_the_value() -> None:
    promise: Promise[int] = Promise()
    mapped = promise.future.then(lambda v: v * 10)
    assert mapped.is_pending()
    promise.set_value(4)
    assert mapped.get() == 40


def test_then_follows_a_returned_future() -> None:
    first: Promise[int] = Promise()
    inner: Promise[str] = Promise()
    chained = first.future.then(lambda v: inner.future)
    first.set_value(1)
    assert chained.is_pending()
    inner.set_value("inner")
    assert chained.get() == "inner"


def test_then_passes_failure_and_discard_unchanged_and_fails_when_fn_raises() -> None:
    error = OSError("write failed")
    failed: Promise[int] = Promise()
    passed = failed.future.then(lambda v: pytest.fail("fn must not run"))
    failed.fail(error)
    assert passed.failure() is error

    discarded: Promise[int] = Promise()
    d = discarded.future.then(lambda v: pytest.fail("fn must not run"))
    discarded.discard()
    assert d.is_discarded()

    raised = Future.ready(0).then(lambda v: 1 // v)
    assert isinstance(raised.failure(), ZeroDivisionError)


def test_recover_supplies_a_value_for_failure_or_discard() -> None:
    error = KeyError("gpu 3")
    failed: Promise[int] = Promise()
    seen: list[BaseException] = []
    recovered = failed.future.recover(lambda e: (seen.append(e), -1)[1])
    failed.fail(error)
    assert recovered.get() == -1 and seen == [error]

    discarded: Promise[int] = Promise()
    from_discard = discarded.future.recover(lambda e: type(e).__name__)
    discarded.discard()
    assert from_discard.get() == "Discarded"

    assert Future.ready(1).recover(lambda e: 2).get() == 1
    assert Future.failed("x").recover(lambda e: Future.ready("via future")).get() == "via future"
    assert isinstance(Future.failed("x").recover(lambda e: 1 // 0).failure(), ZeroDivisionError)


# -- discard --------------------------------------------------------------------
def test_discard_is_a_request_seen_by_the_producer() -> None:
    promise: Promise[int] = Promise()
    asked: list[str] = []
    promise.on_discard(lambda: asked.append("stop"))
    future = promise.future
    assert future.discard() is True
    assert future.has_discard() and future.is_pending()  # a request, not a state
    assert future.discard() is False
    assert asked == ["stop"]
    promise.discard()
    assert future.is_discarded()
    late: list[str] = []
    promise.on_discard(lambda: late.append("at once"))
    assert late == ["at once"]


def test_discard_of_a_completed_future_is_ignored() -> None:
    promise: Promise[int] = Promise()
    asked: list[str] = []
    promise.on_discard(lambda: asked.append("stop"))
    promise.set_value(1)
    assert promise.future.discard() is False and asked == []


def test_discard_propagates_through_then_and_recover_to_the_producer() -> None:
    promise: Promise[int] = Promise()
    asked: list[str] = []
    promise.on_discard(lambda: asked.append("producer"))
    derived = promise.future.then(lambda v: v + 1).recover(lambda e: 0).then(str)
    derived.discard()
    assert asked == ["producer"]
    assert promise.future.has_discard()
    promise.discard()
    # recover turns the discard into a value; the last then maps it
    assert derived.get() == "0"


def test_discard_propagates_into_a_future_returned_by_then() -> None:
    first: Promise[int] = Promise()
    inner: Promise[int] = Promise()
    asked: list[str] = []
    inner.on_discard(lambda: asked.append("inner"))
    chained = first.future.then(lambda v: inner.future)
    first.set_value(1)
    chained.discard()
    assert asked == ["inner"]


# -- collect / await_all --------------------------------------------------------
def test_collect_is_ready_with_all_values_in_order() -> None:
    promises: list[Promise[int]] = [Promise() for _ in range(3)]
    collected = collect(p.future for p in promises)
    for value, promise in zip((2, 0, 1), reversed(promises)):
        assert collected.is_pending()
        promise.set_value(value)
    assert collected.get() == [1, 0, 2]
    assert collect([]).get() == []


def test_collect_fails_with_the_first_failure_and_discards_the_rest() -> None:
    promises: list[Promise[int]] = [Promise() for _ in range(3)]
    collected = collect([p.future for p in promises])
    promises[0].set_value(1)
    error = OSError("first")
    promises[1].fail(error)
    assert collected.failure() is error
    assert promises[2].future.has_discard()  # still pending: asked to stop
    assert not promises[0].future.has_discard()  # already ready: left alone
    promises[2].fail(OSError("second"))
    assert collected.failure() is error


def test_discarding_collect_discards_its_inputs() -> None:
    promises: list[Promise[int]] = [Promise() for _ in range(2)]
    collect([p.future for p in promises]).discard()
    assert all(p.future.has_discard() for p in promises)


def test_await_all_waits_for_every_future_whatever_its_outcome() -> None:
    ok: Promise[int] = Promise()
    bad: Promise[int] = Promise()
    gone: Promise[int] = Promise()
    futures = [ok.future, bad.future, gone.future]
    settled = await_all(futures)
    bad.fail(ValueError("x"))
    gone.discard()
    assert settled.is_pending()
    ok.set_value(1)
    assert settled.get() == futures
    assert [f.state for f in settled.get()] == ["ready", "failed", "discarded"]
    assert await_all([]).get() == []


# -- awaiting and after (both backends) -------------------------------------------
@pytest.mark.anyio
async def test_awaiting_gives_the_value_the_original_exception_or_discarded() -> None:
    async with Runtime():
        assert await Future.ready("now") == "now"
        error = KeyError("k")
        with pytest.raises(KeyError) as info:
            await Future.failed(error)
        assert info.value is error

        promise: Promise[int] = Promise()
        Clock.timer(0, lambda: promise.set_value(9))
        assert await promise.future == 9

        failing: Promise[int] = Promise()
        Clock.timer(0, lambda: failing.fail(error))
        with pytest.raises(KeyError):
            await failing.future

        discarded: Promise[int] = Promise()
        Clock.timer(0, discarded.discard)
        with pytest.raises(Discarded):
            await discarded.future


@pytest.mark.anyio
async def test_after_times_out_on_the_paused_clock() -> None:
    async with Runtime():
        Clock.pause()
        promise: Promise[str] = Promise()
        timed = promise.future.after(5, lambda f: f"timed out, discarding: {f.discard()}")
        Clock.advance(4.999)
        assert timed.is_pending()
        Clock.advance(0.001)
        assert timed.get() == "timed out, discarding: True"
        assert promise.future.has_discard()
        promise.set_value("too late")
        assert timed.get() == "timed out, discarding: True"


@pytest.mark.anyio
async def test_after_passes_an_earlier_outcome_through_and_cancels_its_timer() -> None:
    async with Runtime():
        Clock.pause()
        fired: list[str] = []
        promise: Promise[str] = Promise()
        timed = promise.future.after(5, lambda f: fired.append("timeout"))
        promise.set_value("in time")
        assert await timed == "in time"
        Clock.advance(10)
        assert fired == []

        failing: Promise[str] = Promise()
        timed = failing.future.after(5, lambda f: "timeout")
        failing.fail(OSError("broken"))
        with pytest.raises(OSError, match="broken"):
            await timed


@pytest.mark.anyio
async def test_discarding_after_reaches_the_source() -> None:
    async with Runtime():
        Clock.pause()
        promise: Promise[str] = Promise()
        asked: list[str] = []
        promise.on_discard(lambda: asked.append("source"))
        promise.future.after(5, lambda f: "timeout").discard()
        assert asked == ["source"]
