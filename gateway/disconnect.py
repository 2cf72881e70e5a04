"""The client-disconnect watcher: awaits some work, cancelling it (ClientDisconnected)
when the client's `http.disconnect` arrives first."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request
from starlette.types import Receive

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, cancelling it (ClientDisconnected) if the client disconnects."""
    return await until_disconnect(request.receive, work)


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Awaits `work` in the calling task while one watcher task waits for the client's
    `http.disconnect` and then cancels the caller (ClientDisconnected). Cheaper than
    running `work` as a task of its own next to the watcher: one task, no asyncio.wait."""
    caller = asyncio.current_task()
    if caller is None:
        raise RuntimeError("until_disconnect must run in a task")
    disconnected = False

    async def watch() -> None:
        nonlocal disconnected
        while (await receive())["type"] != "http.disconnect":
            pass
        disconnected = True
        caller.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not disconnected:
            raise
        caller.uncancel()
        raise ClientDisconnected from None
    finally:
        watcher.cancel()
