"""A runner in this process: takes ready steps, runs one async handler per step, records
the results with the step's lease (the words: docs/runners.md).

```python
runner = Runner(store, "nightly-sync", {"fetch": fetch, "sync": sync}, concurrency=4)
await runner.run()        # until runner.stop()
```

- A handler gets the ``TakenStep`` (``params``, the previous step's ``output``,
  ``attempt``…) and returns the step's output (JSON-able, at most 64 KiB encoded), or
  raises: the step fails with ``str(exc)`` and is taken again after the workflow's
  ``retry_backoff`` until ``max_attempts``, then the run fails with that error.
  ``PermanentFailure`` (gateway/runners/handlers.py) fails the run at once.
- The lease is extended at half its length while the handler runs. When the store
  says the step is no longer this runner's (the run was cancelled or failed, or
  moved on), the handler is cancelled and its result discarded; a discarded result
  is logged at info and counted, never retried.
- ``stop()`` stops taking steps; the steps in hand finish within ``grace`` seconds.
  A handler still running after that is cancelled and its step left to its lease:
  when the lease lapses another runner takes it again as a new attempt.
- ``STORE_UNAVAILABLE`` is retried with a bounded backoff; recording a result is
  retried with the same operation id, so a retry after a lost reply reports what the
  first call did.
- Only the steps the handlers cover are taken; the others are left, with no attempt
  counted, to runners that have handlers for them. ``reconfigure()`` swaps the
  handlers between two takes (``realm work`` on SIGHUP).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from gateway.model.errors import RealmError, StoreUnavailable
from gateway.model.words import noun, plural
from gateway.runners import metrics
from gateway.runners.handlers import PermanentFailure

if TYPE_CHECKING:
    from gateway.store.runs import TakenStep
    from gateway.store.runstore import RunStore

log = logging.getLogger("realm.runner")

Handler = Callable[["TakenStep"], Awaitable[Any]]
Result = Literal["ok", "failed", "discarded", "unrecorded"]
# The store's words for "this step is no longer yours": never retried.
DISCARDED = frozenset({"STATE_RUN_NOT_LIVE", "STATE_STEP_NOT_CURRENT", "NOT_FOUND_RUN"})
MAX_ERROR_CHARS = 2000  # of a handler's error, stored on the run
# Draining (run(until_idle=True)): seconds between takes that found nothing, first and
# at most. Otherwise an idle runner waits on Redis (RunStore.wait_for_steps).
IDLE_BACKOFF = (0.05, 1.0)
STORE_BACKOFF = (0.1, 5.0)  # seconds between tries while the store is unavailable
DEFAULT_LEASE_MS = 30_000  # the workflows' default `lease`


@dataclass(frozen=True)
class StepOutcome:
    """What became of one taken step. ``result``: ``ok`` (recorded), ``failed``
    (recorded as a failure: retried later or the run failed), ``discarded`` (the step
    was no longer this runner's), ``unrecorded`` (the store stayed unavailable, or the
    handler was cut short by a stop: the step is taken again after its lease)."""

    run_id: str
    workflow: str
    step: str
    attempt: int
    result: Result
    ms: float
    error: str | None = None
    run_failed: bool = False  # a failure that ended the run: its last attempt, or permanent

    def line(self) -> str:
        result = f"{self.result}, the run failed" if self.run_failed else self.result
        return (
            f"run {self.run_id} step {self.step} attempt {self.attempt}: {result} "
            f"({self.ms:.0f} ms)" + (f": {self.error}" if self.error else "")
        )


class _Setup(NamedTuple):
    """What a runner takes steps with; replaced whole by a reload."""

    store: RunStore
    workflows: list[str]
    handlers: dict[str, Handler]
    handled: dict[str, frozenset[str]]  # per workflow: the steps the handlers cover


def _setup(
    store: RunStore, workflows: str | Sequence[str], handlers: Mapping[str, Handler]
) -> _Setup:
    """Checked: at least one workflow, each known, each with a handler for one of its
    steps at least (ValueError otherwise)."""
    names = [workflows] if isinstance(workflows, str) else list(workflows)
    if not names:
        raise ValueError("a Runner needs at least one workflow")
    names = [store.config.workflow(name).name for name in names]
    handlers = dict(handlers)
    handled: dict[str, frozenset[str]] = {}
    for name in names:
        # A key is a step name, or "workflow:step" (a superset: _handler decides).
        prefix = f"{name}:"
        steps = frozenset(handlers) | {k[len(prefix) :] for k in handlers if k.startswith(prefix)}
        if not steps & set(store.config.workflow(name).steps):
            raise ValueError(f"workflow '{name}': no handler for any of its steps")
        handled[name] = steps
    return _Setup(store, names, handlers, handled)


class Runner:
    """Takes ready steps of ``workflows`` and runs ``handlers`` on them.

    ``handlers`` maps a step name (or ``"workflow:step"``, which wins) to an async
    function of the ``TakenStep``. A step without a handler here is never taken: it
    is left, with no attempt counted, to a runner that has one (logged once). Each
    workflow needs a handler for at least one of its steps. ``lease`` (seconds)
    overrides the workflow's lease for steps taken here.
    """

    def __init__(
        self,
        store: RunStore,
        workflows: str | Sequence[str],
        handlers: Mapping[str, Handler],
        *,
        concurrency: int = 1,
        runner_id: str | None = None,
        lease: float | None = None,
        grace: float = 30.0,
        on_outcome: Callable[[StepOutcome], None] | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.concurrency = concurrency
        self.runner_id = runner_id or f"runner-{uuid.uuid4().hex[:12]}"
        self.store = store
        self.workflows: list[str] = []
        self.handlers: dict[str, Handler] = {}
        self._handled: dict[str, frozenset[str]] = {}  # per workflow: the steps taken here
        self._reconfigured: _Setup | None = None
        self._apply(_setup(store, workflows, handlers))
        self.lease_ms = None if lease is None else max(1, int(lease * 1000))
        self.grace = grace
        self.on_outcome = on_outcome
        self.counts: dict[str, int] = {"ok": 0, "failed": 0, "discarded": 0, "unrecorded": 0}
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()  # ends a wait for steps: stop(), or a reconfigure()
        self._in_hand: set[asyncio.Task[StepOutcome]] = set()
        self._next = 0  # round robin over workflows
        # Steps this runner failed that wait for their retry: (run id, step) → the
        # attempt that failed. run(until_idle=True) waits for them.
        self._retries: dict[tuple[str, str], int] = {}
        self.runs_failed = 0  # runs that failed at a step of this runner's

    def _handler(self, workflow: str, step: str) -> Handler | None:
        return self.handlers.get(f"{workflow}:{step}") or self.handlers.get(step)

    def reconfigure(
        self,
        handlers: Mapping[str, Handler],
        *,
        workflows: str | Sequence[str] | None = None,
        store: RunStore | None = None,
    ) -> None:
        """Take steps with other handlers (and workflows, and a store bound to a newer
        config): a reload. Checked now, as in ``__init__`` (ValueError); applied before
        the next take. A step in hand finishes with the handler and store it began with."""
        names = self.workflows if workflows is None else workflows
        self._reconfigured = _setup(store or self.store, names, handlers)
        self._wake.set()  # a wait for steps in progress ends: the next take uses it

    def _apply(self, setup: _Setup) -> None:
        self.store, self.workflows, self.handlers, self._handled = setup
        # The store hands this runner only the steps it has handlers for.
        self.store.take_only(self.runner_id, self._handled)
        for name in self.workflows:
            left = [s for s in self.store.config.workflow(name).steps if not self._handler(name, s)]
            if left:
                log.info("runner %s: no handler here for %s %s of workflow '%s': left to "
                         "runners that have one", self.runner_id, noun(len(left), "step"),
                         ", ".join(left), name)  # fmt: skip

    def _apply_reconfigured(self) -> None:
        """Between takes: what a step was taken for is what handles it."""
        if not self._stop.is_set():
            self._wake.clear()  # before the check: a reconfigure() after it wakes the wait
        if self._reconfigured is not None:
            setup, self._reconfigured = self._reconfigured, None
            self._apply(setup)

    @property
    def waiting_retries(self) -> int:
        """Steps this runner failed that, as far as it knows, still wait for a retry."""
        return len(self._retries)

    # ------------------------------------------------------------------ loop

    def stop(self) -> None:
        """Stop taking steps; ``run()`` returns once the steps in hand are done (or
        ``grace`` has passed). Safe to call from a signal handler of the loop."""
        self._stop.set()
        self._wake.set()

    def abandon(self) -> None:
        """Stop at once: the steps in hand are cancelled (a command handler's process
        group is killed) and left to their leases, which lapse."""
        self._stop.set()
        self._wake.set()
        for task in list(self._in_hand):
            task.cancel()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def run(self, *, until_idle: bool = False) -> None:
        """Take and handle steps until ``stop()`` (or, with ``until_idle``, until no
        step is ready, none is in hand and none this runner failed waits for its retry)."""
        idle = IDLE_BACKOFF[0]
        store_wait = STORE_BACKOFF[0]
        try:
            while not self._stop.is_set():
                self._apply_reconfigured()
                free = self.concurrency - len(self._in_hand)
                if free <= 0:
                    await self._wait_for_a_free_slot()
                    continue
                try:
                    taken = await self._take(free)
                    if not taken and not until_idle:
                        # Nothing ready: wait on Redis for a new step (a blocking read),
                        # or for stop(), not on a timer; the next take finds the leases
                        # that lapsed and the retries that fell due meanwhile.
                        taken = await self.store.wait_for_steps(
                            self.workflows, self.runner_id, count=free, lease_ms=self.lease_ms,
                            stop=self._wake,
                        )  # fmt: skip
                except StoreUnavailable as exc:
                    log.warning("runner %s: store unavailable, retrying in %.1fs: %s",
                                self.runner_id, store_wait, exc.message)  # fmt: skip
                    await self._sleep(store_wait)
                    store_wait = min(store_wait * 2, STORE_BACKOFF[1])
                    continue
                except Exception:
                    # Not ours to fix here (a bug, a server in a state we do not know): a
                    # worker keeps going, and says so, rather than leave its steps idle.
                    log.exception("runner %s: taking steps failed; retrying in %.1fs",
                                  self.runner_id, store_wait)  # fmt: skip
                    await self._sleep(store_wait)
                    store_wait = min(store_wait * 2, STORE_BACKOFF[1])
                    continue
                store_wait = STORE_BACKOFF[0]
                if taken:
                    idle = IDLE_BACKOFF[0]
                    for step in taken:
                        self._start(step)
                    continue
                if not until_idle:
                    continue  # the wait ended with nothing new: take again
                if not self._in_hand and not await self._retries_due():
                    return
                # Draining, nothing ready: wait a little longer each time (bounded), or
                # until a step in hand finishes and frees a slot, or until stop().
                await self._sleep(idle, wake_on_done=True)
                idle = min(idle * 2, IDLE_BACKOFF[1])
        finally:
            await self._finish_in_hand()
            await self.store.end_waits(self.runner_id)

    async def run_once(self) -> list[StepOutcome]:
        """One take of up to ``concurrency`` steps, each handled and recorded; the
        outcomes (empty when nothing was ready). For tests and simple loops."""
        self._apply_reconfigured()
        taken = await self._take(self.concurrency)
        tasks = [self._start(step) for step in taken]
        return list(await asyncio.gather(*tasks)) if tasks else []

    async def _take(self, count: int) -> list[TakenStep]:
        """Up to ``count`` ready steps, the workflows taken in turn so that a busy one
        cannot starve the others."""
        taken: list[TakenStep] = []
        n = len(self.workflows)
        for i in range(n):
            if len(taken) >= count:
                break
            workflow = self.workflows[(self._next + i) % n]
            try:
                taken += await self.store.take_steps(
                    workflow, self.runner_id, count=count - len(taken), lease_ms=self.lease_ms
                )
            except StoreUnavailable:
                if not taken:
                    raise
                break  # the steps already taken are leased to us: handle them first
        self._next = (self._next + 1) % n
        return taken

    def _start(self, step: TakenStep) -> asyncio.Task[StepOutcome]:
        # Looked up now, with the store it was taken from: a reload later on does not
        # change what handles this step.
        handler = self._handler(step.workflow, step.step)
        assert handler is not None  # the store hands out only the steps in self._handled
        self._retries.pop((step.run_id, step.step), None)
        task = asyncio.create_task(self._handle(step, handler, self.store))
        self._in_hand.add(task)
        task.add_done_callback(self._in_hand.discard)
        return task

    async def _retries_due(self) -> bool:
        """Whether a step this runner failed still waits for its retry: its run is
        still at it (else another runner took it on, or the run ended)."""
        for run_id, step in list(self._retries):
            try:
                run = await self.store.get_run(run_id)
            except StoreUnavailable:
                return True  # cannot tell: the next take finds out
            except RealmError:
                run = None  # gone (swept)
            if run is None or run.phase != "running" or run.step != step:
                del self._retries[(run_id, step)]
        return bool(self._retries)

    async def _wait_for_a_free_slot(self) -> None:
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({stop, *self._in_hand}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()

    async def _sleep(self, seconds: float, *, wake_on_done: bool = False) -> None:
        stop = asyncio.ensure_future(self._stop.wait())
        waits: set[asyncio.Future[Any]] = {stop}
        if wake_on_done and len(self._in_hand) >= self.concurrency:
            waits |= set(self._in_hand)
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()

    async def _finish_in_hand(self) -> None:
        if not self._in_hand:
            return
        _, pending = await asyncio.wait(set(self._in_hand), timeout=self.grace)
        for task in pending:
            task.cancel()  # its lease lapses; another runner takes the step again
        if pending:
            log.warning("runner %s: %s still running after %.0fs; left to their leases",
                        self.runner_id, plural(len(pending), "step"), self.grace)  # fmt: skip
            await asyncio.wait(pending, timeout=10)

    # ------------------------------------------------------------------ one step

    async def _handle(self, step: TakenStep, handler: Handler, store: RunStore) -> StepOutcome:
        started = time.monotonic()

        async def call() -> Any:
            # Inside the task: a handler that raises before its first await, or returns
            # something that is not awaitable, fails its attempt like any other error.
            return await handler(step)

        work = asyncio.ensure_future(call())
        lost: list[RealmError] = []
        keeper = asyncio.create_task(self._keep_lease(store, step, work, lost))
        error: str | None = None
        output: Any = None
        permanent = False
        try:
            output = await work
        except asyncio.CancelledError:
            if not lost:  # a stop past its grace: the step goes back with its lease
                keeper.cancel()
                self._report(self._outcome(step, "unrecorded", started, "stopped mid-step"))
                raise
        except PermanentFailure as exc:
            error, permanent = _error_text(exc), True
        except Exception as exc:
            error = _error_text(exc)
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
        if lost:
            return self._report(self._outcome(step, "discarded", started, lost[0].code))
        try:
            if error is None:
                outcome = await self._complete(store, step, output, started)
            else:
                outcome = await self._fail(store, step, error, started, permanent=permanent)
        except StoreUnavailable as exc:
            outcome = self._outcome(step, "unrecorded", started, exc.message)
        except RealmError as exc:
            result: Result = "discarded" if exc.code in DISCARDED else "unrecorded"
            outcome = self._outcome(step, result, started, exc.code)
        except Exception as exc:  # a bug of ours must not kill the loop: the lease lapses
            log.exception("run %s step %s: recording the result failed", step.run_id, step.step)
            outcome = self._outcome(step, "unrecorded", started, type(exc).__name__)
        return self._report(outcome)

    async def _complete(
        self, store: RunStore, step: TakenStep, output: Any, started: float
    ) -> StepOutcome:
        try:
            await self._recording(lambda op: store.complete_step(
                step.run_id, step.step, lease=step.lease, output=output, entry_id=step.entry_id,
                op_id=op))  # fmt: skip
        except RealmError as exc:
            if exc.code in DISCARDED or isinstance(exc, StoreUnavailable):
                raise
            # The output itself was refused (too large, not JSON): that is the
            # handler's failure, and the step is retried like any other.
            return await self._fail(store, step, f"output refused: {exc.message}", started)
        except TypeError as exc:
            return await self._fail(store, step, f"output is not JSON: {exc}", started)
        return self._outcome(step, "ok", started)

    async def _fail(
        self,
        store: RunStore,
        step: TakenStep,
        error: str,
        started: float,
        *,
        permanent: bool = False,
    ) -> StepOutcome:
        if permanent:
            await self._recording(lambda op: store.fail_run(
                step.run_id, error, lease=step.lease, op_id=op))  # fmt: skip
            run_failed = True
        else:
            failure = await self._recording(lambda op: store.fail_step(
                step.run_id, step.step, error, lease=step.lease, entry_id=step.entry_id,
                op_id=op))  # fmt: skip
            run_failed = failure.phase == "failed"
            if not run_failed:
                self._retries[(step.run_id, step.step)] = step.attempt
        self.runs_failed += run_failed
        return self._outcome(step, "failed", started, error, run_failed=run_failed)

    async def _recording(self, call: Callable[[str], Awaitable[Any]]) -> Any:
        """One result, sent until the store answers: the same operation id each time,
        for at most about one lease (after that the step is someone else's anyway)."""
        op_id = str(uuid.uuid4())
        wait = STORE_BACKOFF[0]
        deadline = time.monotonic() + max(self.lease_ms or DEFAULT_LEASE_MS, 5_000) / 1000
        while True:
            try:
                return await call(op_id)
            except StoreUnavailable:
                if time.monotonic() + wait > deadline:
                    raise
                await asyncio.sleep(wait)
                wait = min(wait * 2, STORE_BACKOFF[1])

    async def _keep_lease(
        self, store: RunStore, step: TakenStep, work: asyncio.Future[Any], lost: list[RealmError]
    ) -> None:
        """Extend the lease at half its length while the handler runs; when the store
        says the step is no longer ours, cancel the handler (its result would be
        discarded anyway)."""
        workflow = store.config.workflow(step.workflow)
        length_ms = self.lease_ms or workflow.lease_ms
        while not work.done():
            await asyncio.sleep(length_ms / 2000)
            if work.done():
                return
            try:
                await store.extend_lease(
                    step.run_id, step.step, step.lease, self.lease_ms, entry_id=step.entry_id
                )
            except StoreUnavailable as exc:
                log.warning("run %s step %s: lease not extended: %s", step.run_id, step.step,
                            exc.message)  # fmt: skip
            except RealmError as exc:
                if exc.code in DISCARDED:
                    lost.append(exc)
                    work.cancel()
                    return
                log.warning("run %s step %s: lease not extended: %s", step.run_id, step.step,
                            exc)  # fmt: skip

    # ------------------------------------------------------------------ outcomes

    def _outcome(
        self,
        step: TakenStep,
        result: Result,
        started: float,
        error: str | None = None,
        *,
        run_failed: bool = False,
    ) -> StepOutcome:
        return StepOutcome(step.run_id, step.workflow, step.step, step.attempt, result,
                           (time.monotonic() - started) * 1000, error, run_failed)  # fmt: skip

    def _report(self, outcome: StepOutcome) -> StepOutcome:
        self.counts[outcome.result] += 1
        metrics.step_done(outcome.workflow, outcome.step, outcome.result, outcome.ms / 1000)
        if outcome.result == "discarded" and outcome.error == "STATE_STEP_NOT_CURRENT":
            metrics.lease_expired(outcome.workflow)  # another runner took the step
        level = logging.WARNING if outcome.result == "unrecorded" else logging.INFO
        log.log(level, "%s", outcome.line())
        if self.on_outcome is not None:
            self.on_outcome(outcome)
        return outcome


def _error_text(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."
