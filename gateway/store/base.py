"""The ground every part of the run store stands on: its connections and scripts, the
keys of each workflow's partitions, finding a run by id, and calling Redis under one
deadline with retries.

``RunStore`` (gateway/store/runstore.py) is made of parts by what they own (starts,
steps, endings, listing, checks), each a subclass of ``StoreBase``: so every part sees
the same state and helpers, and the parts combine into one class. The refusals that
several parts raise (no such run, a run not live, a lease lost) are here too, so a
caller reads the same words whichever operation refused.

Redis trouble raises ``StoreUnavailable`` (the caller answers 503 and the sender
retries, which deduplicates).
"""

from __future__ import annotations

import asyncio
import copy
import re
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, Self, TypeVar

from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from gateway.link.blocking import BlockingReader
from gateway.link.cluster_pipeline import script_pipeline
from gateway.link.connection import unreachable
from gateway.link.durability import confirmed_script
from gateway.link.pool import WAIT_CLOCK
from gateway.link.sentinel import sentinel_pipeline
from gateway.model.config import Config, Workflow
from gateway.model.errors import RealmError, StoreUnavailable
from gateway.store.keys import Keys, partition_keys, partition_of, partition_of_run
from gateway.store.runs import (
    Run,
    check_request_id,
    check_run_id,
    new_run_id,
    run_from_hash,
    text_of,
)
from gateway.store.scripts import Scripts

T = TypeVar("T")

# Script calls one ending may make: each `need_next` reply names the run first in the
# key's queue, and a start or cancel may change that head in between.
MAX_ENDING_CALLS = 64


class StoreBase:
    """The state and helpers the parts of RunStore share: the connections, the scripts,
    the partitions' keys, a run by id, and Redis calls with the store's retries."""

    def __init__(
        self,
        redis: Redis,
        config: Config,
        *,
        timeout: float | None = None,
        pipelined: bool = False,
    ) -> None:
        """``pipelined``: send run starts on one pipelined connection of the store's
        own (see gateway/link/pipeline.py); worth it under concurrent load, as in the
        listener."""
        self.redis = redis
        self.config = config
        self.prefix = config.settings.key_prefix
        self.timeout = config.settings.redis_timeout if timeout is None else timeout
        self.scripts = Scripts(redis)
        # settings.durability: a mutating script counts only once its writes are
        # confirmed on replicas (gateway/link/pipeline.py). A cluster's scripts then always
        # go through the pipeline (redis-py would send WAIT to every node).
        self._durability = config.settings.durability
        self._pipeline = script_pipeline(redis, self.timeout, pipelined, self._durability)
        if pipelined and self._pipeline is None:
            # Under Sentinel: a pipeline that asks the sentinels for the primary on
            # every (re)connect and leaves a demoted one (gateway/link/sentinel.py).
            self._pipeline = sentinel_pipeline(redis, self.timeout, self._durability)
        # The runners' side (gateway/store/steps.py) keeps these; they live as long as
        # the store, so they are set up with it.
        self._groups: set[str] = set()  # workflows whose runner groups exist
        self._autoclaim: dict[str, str] = {}  # per stream: where XAUTOCLAIM goes on
        self._waits: dict[tuple[str, str], BlockingReader] = {}  # per runner and server
        self._only: dict[str, Mapping[str, Collection[str]]] = {}  # per runner (take_only)
        self._keys = {
            name: partition_keys(self.prefix, name, wf.partitions)
            for name, wf in config.workflows.items()
        }

    def with_config(self, config: Config) -> Self:
        """This store serving another version of the config (a reload), on the same
        connections. What the connections depend on (the key prefix, the timeout,
        durability) must be unchanged: gateway/serving/reload.py refuses a file that changes it."""
        other = copy.copy(self)
        other.config = config
        other._keys = {
            name: partition_keys(self.prefix, name, wf.partitions)
            for name, wf in config.workflows.items()
        }
        return other

    def keys(self, workflow: str) -> Keys:
        """The Keys of an unpartitioned workflow (of partition 0 of a partitioned one)."""
        return self.partitions(workflow)[0]

    def partitions(self, workflow: str) -> list[Keys]:
        """The Keys of each of the workflow's partitions (one unless ``partitions: N``)."""
        return self._keys.get(workflow) or [Keys(self.prefix, workflow)]

    def keys_for_key(self, workflow: str, key: str) -> Keys:
        """The partition an idempotency key lives in: always the same one."""
        parts = self.partitions(workflow)
        return parts[partition_of(key, len(parts))]

    def keys_for_run(self, workflow: str, run_id: str) -> Keys:
        """The partition a run lives in, named by its id."""
        parts = self.partitions(workflow)
        return parts[partition_of_run(run_id, len(parts))]

    async def get_run(self, run_id: str, workflow: str | None = None) -> Run:
        """The run with this id; ``NOT_FOUND_RUN`` if no workflow has it."""
        check_run_id(run_id)
        names = [workflow] if workflow else list(self.config.workflows)
        if workflow:
            self.config.workflow(workflow)
        run_keys = [self.keys_for_run(name, run_id).run(run_id) for name in names]
        async with self.deadline():
            found = await self._retrying(lambda: self._hgetall_many(run_keys))
        for data in found:
            if data:
                return run_from_hash(data)
        raise run_not_found(run_id)

    async def _located(self, run_id: str) -> tuple[Run, Workflow, Keys]:
        """A run, its workflow and its partition's keys: what every call on a run by id
        needs (the workflow is known only from the run)."""
        run = await self.get_run(run_id)
        return run, self.config.workflow(run.workflow), self.keys_for_run(run.workflow, run_id)

    async def _run_script(self, script: AsyncScript, keys: list[Any], args: list[Any]) -> Any:
        if self._pipeline is not None:
            return await self._pipeline.evalsha(script, keys, args)
        if self._durability is not None:
            return await confirmed_script(self.redis, script, keys, args, self._durability)
        return await script(keys, args)

    async def _hgetall_many(self, names: list[str]) -> list[dict[bytes, bytes]]:
        # A fresh pipeline per try: a failed pipeline forgets its commands.
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hgetall(name)
            return await pipe.execute()

    @staticmethod
    def _key_keys(keys: Keys, run: Run, next_id: str = "") -> list[str]:
        """The keys an ending of ``run`` touches besides its own: its key's pointer, run
        set and queue, the hash of the run first in that queue (``next_id``, once a
        ``need_next`` reply named it; else the run's own hash) and the workflow's queued
        index. None for a run without a key."""
        if not run.key:
            return []
        return [keys.pointer(run.key), keys.key_runs(run.key), keys.queue(run.key),
                keys.run(next_id or run.id), keys.queued()]  # fmt: skip

    async def _ending(
        self, script: AsyncScript, head: list[str], keys: Keys, run: Run, argv: list[Any]
    ) -> Any:
        """One call of a script that may end ``run`` (``argv`` then gets the id of the run
        waiting first in its key's queue). An ending starts that run in the same call, so
        it needs its hash, and keys are never built inside Lua: a ``need_next`` reply names
        it, and the call goes again (one more round trip, only when a run waits)."""
        next_id = ""
        for _ in range(MAX_ENDING_CALLS):
            script_keys = [*head, *self._key_keys(keys, run, next_id)]
            reply = await self._retrying(
                lambda k=script_keys, a=[*argv, next_id]: self._run_script(script, k, a)
            )
            if reply[0] != b"need_next":
                return reply
            next_id = text_of(reply[1])
        raise StoreUnavailable(
            f"the queue of run {run.id}'s key kept moving ({MAX_ENDING_CALLS} calls); retry"
        )

    def deadline(self) -> _Deadline:
        """One bound on a whole operation: never a hang, whatever Redis does.
        (``async with store.deadline():`` raises StoreUnavailable when it passes.)"""
        return _Deadline(self.timeout)

    async def call(self, call: Callable[[], Awaitable[T]]) -> T:
        """One Redis call of a caller outside the store (the delivery log), with the
        store's retries and its mapping of "not now" errors to StoreUnavailable. The
        caller bounds it (``deadline``)."""
        return await self._retrying(call)

    async def call_script(self, script: AsyncScript, keys: list[Any], args: list[Any]) -> Any:
        """One script call of a caller outside the store (the delivery log's writes),
        with ``call``'s retries. It goes on the store's own connection when there is
        one (packed by hiredis, written with the claims of its loop turn), unless
        writes wait for replicas: the log needs no such wait, nor to hold claims up."""
        if self._pipeline is not None and self._durability is None:
            pipeline = self._pipeline
            return await self._retrying(lambda: pipeline.evalsha(script, keys, args))
        return await self._retrying(lambda: script(keys, args))

    async def _retrying(self, call: Callable[[], Awaitable[T]]) -> T:
        """Run one Redis call; on a dropped connection try once more on a fresh one.

        Every script is safe to repeat: a repeated start finds its own run id
        (the caller-id check), and a repeated end, step, cancel or repair finds the
        record of its operation id and answers what the first attempt did.
        """
        for attempt in (1, 2):
            try:
                return await call()
            except (redis_errors.ConnectionError, redis_errors.TimeoutError) as exc:
                if attempt == 2:
                    raise StoreUnavailable(unreachable(exc)) from None
            except redis_errors.NoScriptError:
                # The script cache was lost again between a reload and its resend:
                # the call did not run, so going again is safe.
                if attempt == 2:
                    raise StoreUnavailable("Redis keeps losing its scripts; retry") from None
            except redis_errors.ResponseError as exc:
                # Replies that mean "not now" (redis-py maps some to their own
                # ResponseError subclasses, and leaves others plain): the command was
                # refused before it ran, nothing was written, and a retry later may pass.
                reply = _reply_of(exc)
                if isinstance(exc, _NOT_NOW) or reply.startswith(NOT_NOW_PREFIXES):
                    raise StoreUnavailable(f"Redis refused the call: {reply}") from None
                raise
            except (redis_errors.ClusterError, redis_errors.RedisClusterException) as exc:
                # A cluster in the middle of a change (redirections that did not settle
                # within redis-py's 16, a slot no node serves) or whose slot map no
                # seed gave: nothing was decided, and a retry later may pass.
                raise StoreUnavailable(f"the cluster is not ready: {_describe(exc)}") from None
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close the store's own pipelined connection (the client is the caller's)."""
        if self._pipeline is not None:
            self._pipeline.close()


# Error replies that mean "not now, retry later" (the command did not run): 503
# STORE_UNAVAILABLE with Retry-After, never 500. BUSY: a script or function is running
# past its time limit; TRYAGAIN/CLUSTERDOWN: a cluster in the middle of a change;
# NOREPLICAS: min-replicas-to-write not met; MISCONF: a failed save blocks writes.
# "BUSY " with its space: BUSYGROUP (a consumer group that exists) is no "not now".
NOT_NOW_PREFIXES = (
    "BUSY ", "LOADING", "READONLY", "MASTERDOWN", "MISCONF", "OOM", "TRYAGAIN",
    "CLUSTERDOWN", "NOREPLICAS",
)  # fmt: skip
# redis-py rewrites an error reply to a pipelined command as "Command # 1 (GET k) of
# pipeline caused error: ('BUSY …',)" (the reply bare, not in a tuple, before 6.0),
# which no prefix of a reply matches: the reply it wraps is what is classified.
_PIPELINE_ERROR = re.compile(
    r"Command # \d+ \(.*\) of pipeline caused error: (?:\((['\"])(.*)\1,\)|(.*))", re.DOTALL
)


def _reply_of(exc: redis_errors.ResponseError) -> str:
    """The server's error reply that ``exc`` holds, unwrapped from a pipeline's message."""
    text = str(exc)
    wrapped = _PIPELINE_ERROR.fullmatch(text)
    if wrapped is None:
        return text
    return wrapped.group(2) if wrapped.group(1) else wrapped.group(3)


_NOT_NOW = (
    redis_errors.OutOfMemoryError,
    redis_errors.ReadOnlyError,
    redis_errors.MasterDownError,
    # A cluster's client maps these replies to its own classes, without the prefix:
    # CLUSTERDOWN, TRYAGAIN, and a MOVED or ASK it did not follow (in a pipeline).
    redis_errors.ClusterDownError,
    redis_errors.TryAgainError,
    redis_errors.AskError,
)


class _Deadline:
    """``asyncio.timeout`` that ends in ``StoreUnavailable``. A class, not a generator
    context manager: it is entered once per delivery, on the hot path.

    It times Redis, not this process: while a call of the operation waits for a pool
    connection (gateway/link/pool.py) it is paused, with the deadlines it is nested in.
    Calls of one operation may wait at once (gather): paused while any of them waits."""

    __slots__ = ("_left", "_outer", "_timeout", "_token", "_waiting", "seconds")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._waiting = 0

    async def __aenter__(self) -> None:
        self._timeout = asyncio.timeout(self.seconds)
        await self._timeout.__aenter__()
        self._outer = WAIT_CLOCK.get()
        self._token = WAIT_CLOCK.set(self)

    def wait_started(self) -> None:
        self._waiting += 1
        if self._waiting == 1:
            when = self._timeout.when()
            self._left = None if when is None else when - asyncio.get_running_loop().time()
            self._reschedule(None)
        if self._outer is not None:
            self._outer.wait_started()

    def wait_ended(self) -> None:
        self._waiting -= 1
        if self._waiting == 0 and self._left is not None:
            self._reschedule(asyncio.get_running_loop().time() + self._left)
        if self._outer is not None:
            self._outer.wait_ended()

    def _reschedule(self, when: float | None) -> None:
        # Not once the timeout fired or the operation ended: then there is nothing to move.
        if not self._timeout.expired() and self._token is not None:
            self._timeout.reschedule(when)

    async def __aexit__(self, *exc_info: Any) -> None:
        WAIT_CLOCK.reset(self._token)
        self._token = None
        try:
            await self._timeout.__aexit__(*exc_info)
        except TimeoutError:
            raise StoreUnavailable(
                f"Redis did not answer within {self.seconds:g} s; the outcome is unknown, retry"
            ) from None


# -- refusals and ids that several parts of the store share -------------------------


def op_id_or_new(op_id: str | None) -> str:
    """The caller's operation id, checked, or a new one: the scripts record what an
    operation did under its id, so that a resend answers the same."""
    if op_id is None:
        return new_run_id()
    check_request_id(op_id, "request_id")
    return op_id


def lease_lost(run_id: str, step: str = "") -> RealmError:
    at = f" step '{step}' of" if step else ""
    return RealmError(
        "STATE_STEP_NOT_CURRENT",
        f"Another runner holds a newer lease on{at} run '{run_id}'; the result was discarded.",
    )


def run_not_found(run_id: str) -> RealmError:
    return RealmError("NOT_FOUND_RUN", f"No run '{run_id}' (it never existed or has expired).")


def not_live(run_id: str, phase: str) -> RealmError:
    return RealmError(
        "STATE_RUN_NOT_LIVE",
        f"Run '{run_id}' is not live (phase '{phase}'); the result was discarded.",
    )


# What each kind of call a script records under an operation id did (op_recall in
# gateway/store/lua/_lib.lua), for the refusal of an id reused for another call.
_CALLS = {
    "complete_step": "completing step '{step}' of run '{target}'",
    "fail_step": "failing an attempt at step '{step}' of run '{target}'",
    "failed": "failing run '{target}'",
    "cancelled": "cancelling run '{target}'",
    "cancel_key": "cancelling the live run of an idempotency key",
}


def check_op_reused(reply: Sequence[Any]) -> None:
    """Raise STATE_REQUEST_ID_REUSED when a script answered ``op_reused``: the operation
    id (a caller's ``request_id``) already named another call, whose answer it would
    otherwise have got without anything done."""
    if not reply or text_of(reply[0]) != "op_reused":
        return
    kind, target, step = ([text_of(x) for x in reply[1:4]] + ["", "", ""])[:3]
    earlier = _CALLS.get(kind, "another kind of call").format(target=target, step=step)
    raise RealmError(
        "STATE_REQUEST_ID_REUSED",
        f"This request_id already named another call ({earlier}); a request_id names one "
        "call: send this one with a new request_id.",
    )


def _describe(exc: BaseException) -> str:
    # redis-py messages can embed the URL; keep only the reason (no password).
    text = str(exc).split(" connecting to ")[0]
    return text or type(exc).__name__
