"""Set-ups that start with the session, in the background, while the other tests run.

`make test` runs one test at a time, and on a 2-core host it keeps about one core busy
on average (user + sys time is close to the wall time). The two longest set-ups are
single-threaded work of their own:
- the Triton interpreter's child pytest;
- the default model's mesh, whose worker compiles its forward.

So they run on the core the suite leaves idle, at a lower priority than the tests. A
test module registers such a set-up under the name of the fixture that serves it
(`register`). If any selected test uses that fixture, the set-up starts when collection
ends, on one background thread that runs the registered set-ups one after the other. The
tests that use it move to the end of the run, and the fixture takes the result there
(`take`), waiting if it is not ready.
A set-up no selected test uses never starts; one that was not started runs when it is
taken, as an ordinary fixture would.

A set-up is a function that returns a context manager. What it enters is exited when
the fixture releases it (`release`) or, at the latest, when the session ends.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from typing import Any

import pytest


@dataclass
class _SetUp:
    make: Callable[[], AbstractContextManager[Any]]
    done: threading.Event = field(default_factory=threading.Event)
    scheduled: bool = False
    value: Any = None
    error: BaseException | None = None
    stack: ExitStack = field(default_factory=ExitStack)

    def run(self) -> None:
        try:
            self.value = self.stack.enter_context(self.make())
        except BaseException as exc:  # handed to the test that takes it
            self.error = exc
        finally:
            self.done.set()


LANE_NICENESS = 19
_SET_UPS: dict[str, _SetUp] = {}
_lane: threading.Thread | None = None


def register(fixture: str, make: Callable[[], AbstractContextManager[Any]]) -> None:
    """`make` is the set-up the fixture named `fixture` serves (called at a test module's import)."""
    _SET_UPS[fixture] = _SetUp(make)


def take(fixture: str, timeout: float) -> Any:
    """The value of `fixture`'s set-up: waits up to `timeout` s for one started in the
    background, runs one that was not started, and raises what the set-up raised."""
    set_up = _SET_UPS[fixture]
    if not set_up.scheduled:
        set_up.scheduled = True
        set_up.run()
    if not set_up.done.wait(timeout):
        raise TimeoutError(f"the head start of {fixture} did not finish within {timeout} s")
    if set_up.error is not None:
        raise set_up.error
    return set_up.value


def release(fixture: str) -> None:
    """Exits what `fixture`'s set-up entered (stops its mesh)."""
    _SET_UPS[fixture].stack.close()


def start(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Moves the tests that use a registered set-up to the end of `items` and starts
    their set-ups in the background (called once the selection is final)."""
    used = [name for name in _SET_UPS if any(name in getattr(i, "fixturenames", ()) for i in items)]
    if not used or config.option.collectonly:
        return
    late = {id(i) for i in items if any(name in getattr(i, "fixturenames", ()) for name in used)}
    items[:] = [i for i in items if id(i) not in late] + [i for i in items if id(i) in late]
    for name in used:
        _SET_UPS[name].scheduled = True
    global _lane
    _lane = threading.Thread(target=_run_in_order, args=(used,), name="head-start", daemon=True)
    _lane.start()
    config.add_cleanup(_finish)


def _run_in_order(names: list[str]) -> None:
    # Niced, as are the processes it starts (fork keeps the thread's nice value on Linux): where
    # the suite wants both cores, its tests go first, and their time limits hold as they would
    # without a head start.
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LANE_NICENESS)
    for name in names:
        _SET_UPS[name].run()


def _finish() -> None:
    """At the session's end: waits for a set-up still starting, then exits every one."""
    if _lane is not None:
        _lane.join()
    for set_up in _SET_UPS.values():
        set_up.stack.close()
