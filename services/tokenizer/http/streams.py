"""Async plumbing of the HTTP front: merging the streams of a multi-prompt request, and awaiting
something only as long as the client is still connected."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")
_END = object()


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of all streams as they come, tagged with the stream's position. The first error of any
    stream ends the merge; closing it (or an error) closes every stream."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[T]) -> None:
        try:
            async for item in s:
                queue.put_nowait((i, item))
        except Exception as e:  # handed to the consumer, who raises it
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, _END))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            i, item = await queue.get()
            if item is _END:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item  # type: ignore[misc]
    finally:
        for t in tasks:
            t.cancel()  # a cancelled stream's own clean-up aborts its request downstream
        await asyncio.gather(*tasks, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    # The body has been read: the next message is http.disconnect, once the client goes away.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, aw: Awaitable[T]) -> T:
    """The result of ``aw``; if the client disconnects first, ``aw`` is cancelled and ``ClientGone``
    raised."""
    work = asyncio.ensure_future(aw)
    watch = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise ClientGone
    return work.result()
