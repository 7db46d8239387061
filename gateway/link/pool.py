"""The connection pool of a client (gateway/link/connection.py, gateway/link/sentinel.py):
a call that finds every connection busy waits for one in a bounded queue, and its
operation's deadline does not run while it waits.

A call queued for a connection has not reached Redis: the time it waits says how busy
this worker is, not how Redis answers. So the store's deadline (gateway/store/base.py)
registers itself in ``WAIT_CLOCK`` and the pool pauses it while a call of its operation
waits; the deadline times what Redis takes from when the call is sent. The queue is
bounded instead: past ``MAX_WAITING`` waiting calls, a call is refused at once with
``Overloaded`` (503 ``OVERLOADED``, retry in a second), never "Redis is unavailable".
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from typing import Any, Protocol

from redis.asyncio import BlockingConnectionPool

from gateway.model.errors import Overloaded, StoreUnavailable

# Calls that may wait for a connection of one pool (of one worker's client) at once:
# ten per connection of the default 100. A burst of admin reads, or a read of every
# partition of many workflows, queues; a flood that would wait longer than its caller
# is refused.
MAX_WAITING = 1000
# The longest a call waits for a connection. Every holder of one is bounded by its own
# deadline, so a wait this long means connections are held by calls that hang.
MAX_WAIT_SECONDS = 30.0


class WaitClock(Protocol):
    """What the pool tells the operation a call belongs to (the store's deadline)."""

    def wait_started(self) -> None: ...

    def wait_ended(self) -> None: ...


# The deadline of the operation running in this task (asyncio.gather's tasks copy it).
WAIT_CLOCK: ContextVar[WaitClock | None] = ContextVar("realm_wait_clock", default=None)


class QueuedPool(BlockingConnectionPool):
    """redis-py's blocking pool with a bounded queue, whose waits pause the waiting
    operation's deadline (``WAIT_CLOCK``)."""

    def __init__(self, *args: Any, max_waiting: int = MAX_WAITING, **kwargs: Any) -> None:
        # The wait is bounded here (``MAX_WAIT_SECONDS``), not by redis-py's own timeout,
        # which would end it in a ConnectionError that reads as "Redis is unreachable".
        kwargs["timeout"] = None
        super().__init__(*args, **kwargs)
        self.max_waiting = max_waiting
        self.waiting = 0

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        if self.can_get_connection():
            return await super().get_connection(*args, **kwargs)
        if self.waiting >= self.max_waiting:
            raise Overloaded(
                f"this worker already has {self.waiting} Redis calls waiting for one of its "
                f"{self.max_connections} connections; retry in a second"
            )
        clock = WAIT_CLOCK.get()
        self.waiting += 1
        if clock is not None:
            clock.wait_started()
        try:
            async with asyncio.timeout(MAX_WAIT_SECONDS):
                return await super().get_connection(*args, **kwargs)
        except TimeoutError:
            raise StoreUnavailable(
                f"no Redis connection came free within {MAX_WAIT_SECONDS:g} s; retry"
            ) from None
        finally:
            self.waiting -= 1
            if clock is not None:
                clock.wait_ended()
