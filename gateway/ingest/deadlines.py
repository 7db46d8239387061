"""Deadlines for many tasks with one timer: a sweep every ``TICK`` seconds cancels
the tasks whose deadline has passed.

``asyncio.timeout`` schedules and cancels a timer handle per use, about 7.5 us a
delivery (measured; a tenth of the whole request path). Deliveries need bounds,
not millisecond precision: a deadline here fires within ``TICK`` of its time.
"""

from __future__ import annotations

import asyncio

TICK = 0.05  # seconds: how late a deadline may fire


class Deadlines:
    def __init__(self) -> None:
        self._due: dict[asyncio.Task[object], float] = {}
        self._expired: set[asyncio.Task[object]] = set()

    def set(self, task: asyncio.Task[object], seconds: float) -> None:
        """``task`` is cancelled if it still runs ``seconds`` from now (or moves its deadline)."""
        self._due[task] = asyncio.get_running_loop().time() + seconds

    def clear(self, task: asyncio.Task[object]) -> bool:
        """Forget ``task``; True if its deadline had passed and it was cancelled for it.

        Call it when the task catches CancelledError: on True the cancellation was
        ours (``task.uncancel()`` it and answer), on False someone else's (re-raise).
        """
        self._due.pop(task, None)
        if task in self._expired:
            self._expired.discard(task)
            return True
        return False

    async def sweep(self) -> None:
        """Runs for the life of the app, on its event loop."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(TICK)
            now = loop.time()
            late = [task for task, due in self._due.items() if due <= now]
            for task in late:
                del self._due[task]
                self._expired.add(task)
                task.cancel()
