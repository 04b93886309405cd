"""Ctrl-C during a blocking call: the call ends in the connection's thread too, so it happened in full
or not at all. Plain (not trio) tests: the blocking calls run in the main thread, where a signal handler
raises, as Ctrl-C's does; the fake broker runs in a thread of its own."""

from __future__ import annotations

import dis
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from types import CodeType, FrameType
from typing import Any

import pytest
import trio

from flowbroker.client import blocking, interruptible
from flowbroker.client.errors import PublishFailures
from flowbroker.client.interruptible import run_interruptible
from flowbroker.protocol import Deliver, DeliveryEntry
from tests.client.fakebroker import FakeBroker


class Interrupt(BaseException):
    """What the test's SIGINT handler raises (KeyboardInterrupt's stand-in, so a stray one fails only
    the test)."""


class Again(BaseException):
    """A further interrupt, raised by `raising_at_site` where a signal handler could run."""


@contextmanager
def interrupted_after(seconds: float, landed: list[bool] | None = None) -> Iterator[None]:
    """The block must end by the Interrupt that SIGINT raises in this thread after `seconds` (noted in
    `landed` when it is raised)."""

    def handler(signum: int, frame: Any) -> None:
        if landed is not None:
            landed.append(True)
        raise Interrupt

    previous = signal.signal(signal.SIGINT, handler)
    timer = threading.Timer(seconds, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(Interrupt):
            yield
    finally:
        timer.cancel()
        timer.join()
        signal.signal(signal.SIGINT, previous)


def _check_sites(code: CodeType) -> tuple[frozenset[int], frozenset[int]]:
    """The offsets in `code` just after a call, and of its backward jumps."""
    instructions = list(dis.get_instructions(code))
    after_calls = {b.offset for a, b in zip(instructions, instructions[1:]) if a.opname.startswith("CALL")}
    return frozenset(after_calls), frozenset(i.offset for i in instructions if i.opname.startswith("JUMP_BACKWARD"))


@contextmanager
def raising_at_site(
    n: int, traced: Callable[[str], bool], exc: type[BaseException], after: list[bool] | None = None
) -> Iterator[list[bool]]:
    """Raise `exc` at the `n`th place this thread reaches, in the files `traced` accepts, where CPython 3.11
    runs a pending signal's handler: a function's start (also of one called there), a loop's backward jump, just after a call of C
    code returns (one that ran no Python function: after one that did, there is a place only if the call was
    not inlined, which this cannot tell, so it takes none); counting once `after` is not empty, if given.
    Yields a list that is [True] if it did. A tracer's exception is raised in the traced frame, as a
    handler's is."""
    fired: list[bool] = []
    count = 0
    python_calls = 0
    sites: dict[CodeType, tuple[frozenset[int], frozenset[int]]] = {}
    seen: dict[FrameType, int] = {}

    def site() -> None:
        nonlocal count
        if after is None or after:
            count += 1
            if count == n:
                fired.append(True)
                raise exc  # (and tracing stops)

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            code = frame.f_code
            if code not in sites:
                sites[code] = _check_sites(code)
            after_calls, backward_jumps = sites[code]
            calls_before, seen[frame] = seen.get(frame), python_calls
            if (frame.f_lasti in after_calls and calls_before == python_calls) or frame.f_lasti in backward_jumps:
                site()
        return local

    def calls(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal python_calls
        python_calls += 1
        if traced(frame.f_code.co_filename):
            frame.f_trace_lines = False
            frame.f_trace_opcodes = True
            site()
            return local
        if frame.f_back is not None and traced(frame.f_back.f_code.co_filename):
            site()  # the start of a function called there
        return None

    sys.settrace(calls)
    try:
        yield fired
    finally:
        sys.settrace(None)


@contextmanager
def broker_thread(**options: Any) -> Iterator[tuple[FakeBroker, Callable[..., Any]]]:
    """A FakeBroker in a trio run of its own thread, and a function to run its coroutines there."""
    started = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            box["broker"] = FakeBroker(**options)
            await nursery.start(box["broker"].serve)
            box["token"], box["stop"] = trio.lowlevel.current_trio_token(), trio.Event()
            started.set()
            await box["stop"].wait()
            nursery.cancel_scope.cancel()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert started.wait(5)

    def in_broker(afn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        return trio.from_thread.run(afn, *args, trio_token=box["token"])

    try:
        yield box["broker"], in_broker
    finally:
        trio.from_thread.run_sync(box["stop"].set, trio_token=box["token"])
        thread.join(5)


@contextmanager
def trio_thread() -> Iterator[trio.lowlevel.TrioToken]:
    """A trio run in a thread of its own, idle, for `run_interruptible` to call into: its token."""
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        box["token"], box["stop"] = trio.lowlevel.current_trio_token(), trio.Event()
        ready.set()
        await box["stop"].wait()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert ready.wait(5)
    try:
        yield box["token"]
    finally:
        trio.from_thread.run_sync(box["stop"].set, trio_token=box["token"])
        thread.join(5)


def test_an_interrupted_receive_takes_no_message() -> None:
    with broker_thread() as (broker, in_broker):
        with blocking.connect(broker.url, timeout=5) as conn:
            fake = in_broker(broker.connection)
            with conn.consumer("q", prefetch=1) as consumer:
                with interrupted_after(0.3):
                    consumer.receive()
                sub_id = consumer._consumer.subscription_id
                in_broker(fake.send, Deliver(sub_id, [DeliveryEntry(1, "", "q", b"next", None, False)]))
                # A tester's interrupted receive went on in the connection's thread and took this one,
                # handed to nobody: with prefetch 1 the consumer stalled for good.
                assert consumer.receive(timeout=5).body == b"next"


def test_an_interrupted_send_is_not_sent() -> None:
    with broker_thread(auto_complete=False) as (broker, in_broker):
        with blocking.connect(broker.url, timeout=5, close_timeout=1) as conn:
            fake = in_broker(broker.connection)
            producer = conn.producer(routing_key="q", window=1)
            producer.send(b"first", timeout=5)
            with interrupted_after(0.3):
                producer.send(b"second", timeout=30)  # waits for the window
            in_broker(fake.complete)
            producer.flush(timeout=5)
            time.sleep(0.2)
            # A tester's interrupted send sent its message once credit came: the application believed
            # it unsent, and its retry duplicated it.
            assert [entry.body for entry, _ in fake.transfers.values()] == [b"first"]
            assert producer.statistics().sent == 1


def test_an_interrupted_close_is_finished_by_the_next() -> None:
    with broker_thread(auto_complete=False) as (broker, in_broker):
        conn = blocking.connect(broker.url, timeout=5, close_timeout=1.5)
        conn.producer(routing_key="q").send(b"never completed", timeout=5)
        with interrupted_after(0.3):
            conn.close()  # waits for the completion, up to close_timeout
        # A tester's interrupted close (in Thread.join, bpo-45274) left is_closed True with the close still
        # running, and close() again returned None at once: its PublishFailures were raised by a third.
        assert not conn.is_closed
        started = time.monotonic()
        with pytest.raises(PublishFailures, match="1 message sent and not completed"):
            conn.close()
        assert 0.9 < time.monotonic() - started < 3.0
        assert conn.is_closed
        assert not conn._thread.is_alive()
        conn.close()  # raised once


def test_an_interrupted_connect_leaves_no_connection_nor_thread() -> None:
    with socket.socket() as silent:  # accepts the TCP connection, never answers HELLO
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        url = "flowbroker://127.0.0.1:%d" % silent.getsockname()[1]
        with interrupted_after(0.3):
            blocking.connect(url, timeout=10)
        # The connect is cancelled and its thread ends: a tester's went on for the process's life.
        assert [t for t in threading.enumerate() if t.name == f"flowbroker {url}"] == []
        accepted, _ = silent.accept()
        with accepted:
            accepted.settimeout(2)
            while accepted.recv(4096):  # the HELLO, then the end of the stream
                pass


def test_a_call_that_returns_after_the_interrupt_is_undone() -> None:
    undone: list[str] = []

    async def uncancellable() -> str:
        with trio.CancelScope(shield=True):
            await trio.sleep(0.5)
        return "taken"

    with trio_thread() as token:
        with interrupted_after(0.1):
            run_interruptible(token, uncancellable, undone.append)
        assert undone == ["taken"]  # it ended within the wait, and was handed back


def test_a_second_interrupt_while_the_first_cancels_leaves_nothing_running() -> None:
    """A second interrupt at each place of the cancel where one can land, in turn: the call is still cancelled, and the first
    interrupt goes on."""

    def traced(filename: str) -> bool:
        return filename == interruptible.__file__

    escaped: list[int] = []
    with broker_thread(auto_complete=False) as (broker, in_broker):
        with blocking.connect(broker.url, timeout=5, close_timeout=1) as conn:
            fake = in_broker(broker.connection)
            producer = conn.producer(routing_key="q", window=1)
            producer.send(b"first", timeout=5)
            for site in range(1, 100):
                landed: list[bool] = []
                try:
                    with raising_at_site(site, traced, Again, after=landed) as fired:
                        with interrupted_after(0.05, landed):
                            producer.send(b"second", timeout=30)  # waits for the window
                except Again:
                    escaped.append(site)
                if not fired:  # past the cancel's last place
                    break
            else:
                raise AssertionError("the cancel has more than 100 places")
            assert site > 2
            in_broker(fake.complete)
            time.sleep(0.2)
            # A tester's send interrupted every 3 ms was sent after the caller was told it was not, when the
            # second interrupt landed before the cancel was scheduled: its retry duplicated the message.
            assert [entry.body for entry, _ in fake.transfers.values()] == [b"first"]
            assert producer.statistics().sent == 1
    assert escaped == []  # the first interrupt went on, each time


@pytest.mark.parametrize("how", ["receive", "receive_many", "iterator"])
def test_an_interrupt_anywhere_in_a_receive_loses_no_message(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupt at each place of a receive where one can land, in turn, in the SDK's code and trio's and
    outcome's in the calling thread: each message comes once, in order, to a receive or to the next one."""

    def traced(filename: str) -> bool:
        return filename in (blocking.__file__, interruptible.__file__) or filename.endswith(
            ("/trio/_threads.py", "/outcome/_impl.py"))

    # One interrupted before its call reached the trio thread waits CANCEL_WAIT for an end that never comes.
    monkeypatch.setattr(interruptible, "CANCEL_WAIT", 0.1)
    count = 300
    with broker_thread() as (broker, in_broker):
        with blocking.connect(broker.url, timeout=5) as conn:
            fake = in_broker(broker.connection)
            with conn.consumer("q", prefetch=1000) as consumer:
                sub_id = consumer._consumer.subscription_id
                entries = [DeliveryEntry(i + 1, "", "q", b"%d" % i, None, False) for i in range(count)]
                in_broker(fake.send, Deliver(sub_id, entries))
                deadline = time.monotonic() + 5
                while consumer.statistics().buffered < count:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                received: list[bytes] = []
                iterator = iter(consumer)
                for site in range(1, count):
                    with raising_at_site(site, traced, Interrupt) as fired:
                        try:
                            if how == "receive":
                                received.append(consumer.receive(timeout=5).body)
                            elif how == "receive_many":
                                received.extend(m.body for m in consumer.receive_many(1, 5))
                            else:
                                received.append(next(iterator).body)
                        except Interrupt:
                            iterator = iter(consumer)  # (the interrupt ended the one before)
                    if not fired:  # past the receive's last place
                        break
                else:
                    raise AssertionError(f"a receive has more than {count} places")
                assert site > 10
                received.extend(m.body for m in consumer.receive_many(count, 0))
                # A tester's interrupt landing in BlockingMessage's making, after the trio call had returned
                # the message, lost it: nobody settled it, and with prefetch 1 the consumer stalled for good.
                assert received == [b"%d" % i for i in range(count)]


class Refused(Exception):
    """The call's own error (a refusal that `flush()` reports once)."""


def test_an_error_the_interrupted_caller_never_saw_is_restored() -> None:
    """A Ctrl-C as `flush()` raised its refusal: the KeyboardInterrupt went on, the refusal was lost (flush
    reports it once), the retried flush returned normally and the message passed for delivered (a tester:
    6 % of interrupted flushes). The call's own error goes to `restore`; one the caller did see does not."""
    restored: list[BaseException] = []

    async def refused_late() -> None:
        with trio.CancelScope(shield=True):
            await trio.sleep(0.5)
        raise Refused("no queue named 'q'")

    async def refused_now() -> None:
        raise Refused("at once")

    with trio_thread() as token:
        with interrupted_after(0.1):
            run_interruptible(token, refused_late, None, restored.append)
        trio.from_thread.run_sync(lambda: None, trio_token=token)  # (restore ran before this)
        assert [str(e) for e in restored] == ["no queue named 'q'"]
        with pytest.raises(Refused):
            run_interruptible(token, refused_now, None, restored.append)
        trio.from_thread.run_sync(lambda: None, trio_token=token)
        assert len(restored) == 1  # seen by its caller: not restored


def test_a_refusal_an_interrupted_flush_never_reported_is_reported_by_the_next() -> None:
    """The producer side of the above: what the lost flush had forgotten is put back for the next."""
    from flowbroker.client.errors import NotFound, PublishError
    from flowbroker.protocol.errors import ErrorCode

    with broker_thread() as (broker, in_broker):
        with blocking.connect(broker.url, timeout=5) as conn:
            producer = conn.producer(routing_key="q")
            inner = producer._producer
            error = NotFound(ErrorCode.NOT_FOUND, "no queue named 'q'", "q")
            assert isinstance(error, PublishError)

            def refuse() -> None:
                inner._errors.append(error)
                inner._unreported += 1

            conn._run_sync(refuse)
            with pytest.raises(NotFound):
                producer.flush(timeout=5)
            conn._run_sync(inner._restore_errors, error)  # as run_interruptible does for an interrupted one
            with pytest.raises(NotFound):
                producer.flush(timeout=5)
            producer.flush(timeout=5)  # reported: once more, not twice
