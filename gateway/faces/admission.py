"""How many admin reads of one worker work at once (``Admission``).

A read of a page of runs is mostly this process's CPU: parsing a few hundred hashes
and writing them as JSON. Let 250 of them run at once and each one's Redis calls are
answered promptly, but read late, behind the other 249: the store's deadline, which
times Redis, then fires on a healthy Redis (503 STORE_UNAVAILABLE). So a few reads run
at a time and the rest wait their turn before their deadline starts; the wait is
bounded, and a read that finds it full is refused at once with 503 ``OVERLOADED``.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from gateway.model.errors import Overloaded

# Reads at once, per worker: enough to keep Redis busy while one parses its replies,
# few enough that a reply waits for a handful of others, not a hundred. Measured with
# 250 reads of 200 runs at once on 2 cores busy with other work (load 9): with 100 at a
# time the slowest took 2.5 s and 181 passed a 2 s deadline; with 16, 0.7 s; with 4,
# 0.3 s, and all 250 were done sooner than with 100.
READ_SLOTS = 4
# Reads that may wait for a slot (some ten seconds of 200-run pages); past it, OVERLOADED.
READ_QUEUE = 1000


class Admission:
    """``async with admission:`` runs the block in one of ``slots`` slots, after
    waiting for one in a queue of at most ``queue``; a full queue raises Overloaded."""

    def __init__(self, slots: int = READ_SLOTS, queue: int = READ_QUEUE) -> None:
        self.slots = slots
        self.queue = queue
        self.waiting = 0
        # Made at first use: bound to the running loop, not to the one importing us.
        self._free: asyncio.Semaphore | None = None

    async def __aenter__(self) -> None:
        if self._free is None:
            self._free = asyncio.Semaphore(self.slots)
        if self._free.locked():
            if self.waiting >= self.queue:
                raise Overloaded(
                    f"this worker has {self.waiting} admin reads waiting for their turn "
                    "already; retry in a second"
                )
            self.waiting += 1
            try:
                await self._free.acquire()
            finally:
                self.waiting -= 1
        else:
            await self._free.acquire()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._free is not None
        self._free.release()
