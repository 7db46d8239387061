"""Property-based: random starts, repeats, cancels, steps, fails and reruns with random
policies, checked after every step against a small in-memory model of the policy table.
Reconcile walks (dry or repairing) run between steps and concurrently with starts:
on a consistent store they never change which run a key points at."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from gateway.link.connection import redis_client
from gateway.loading import parse_config
from gateway.model.errors import RealmError
from gateway.store.keys import Keys
from gateway.store.policy import KeyState, decide
from gateway.store.reconcile import ReconcileReport, reconcile
from gateway.store.runs import LIVE_MATCH, TERMINAL_MATCH, fingerprint_of
from gateway.store.runstore import RunStore
from tests.conftest import WORKFLOWS_YAML

T = TypeVar("T")
KEYS = ["a", "b", "c"]
PARAMS = [{}, {"n": 1}]
STEPS = ("fetch", "transform", "load")
keys = st.sampled_from(KEYS)


class _Loop:
    """One event loop in a thread: the state machine's rules are synchronous."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


@pytest.mark.slow
def test_the_store_matches_the_model(redis_server):
    loop = _Loop()
    config = parse_config(WORKFLOWS_YAML, with_triggers=False)
    client = loop.run(_client(redis_server.url))

    class Model(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            loop.run(client.flushall())
            self.store = RunStore(client, config, timeout=10)
            # The model: per key, its runs oldest first as [id, phase, step index, fp].
            self.runs: dict[str, list[list[Any]]] = {k: [] for k in KEYS}

        def _state(self, key: str) -> KeyState | None:
            if not self.runs[key]:
                return None
            run_id, phase, _, fp = self.runs[key][-1]
            return KeyState(run_id, phase, fp)

        @rule(
            key=keys,
            params=st.sampled_from(PARAMS),
            # `queue` waits instead of deciding: tests/test_queues.py covers it.
            live=st.sampled_from([m for m in LIVE_MATCH if m != "queue"]),
            terminal=st.sampled_from(TERMINAL_MATCH),
            mismatch=st.sampled_from(["flag", "reject"]),
            repair=st.sampled_from([None, "before", "racing"]),
        )
        def start(
            self, key: str, params: dict, live: str, terminal: str, mismatch: str,
            repair: str | None,
        ) -> None:  # fmt: skip
            """A start; with ``repair``, a repairing reconcile walk runs just before
            it, or at the same time (interleaved at every await of both)."""
            fp = fingerprint_of(b'{"n":1}' if params else b"{}")
            expected = decide(self._state(key), live, terminal, mismatch, fp)
            if repair == "before":
                self._reconcile(dry_run=False)

            async def both() -> Any:
                starting = self.store.start_run("sync", params, key, live, terminal,
                                                mismatch)  # type: ignore[arg-type]  # fmt: skip
                if repair != "racing":
                    return await starting
                report, outcome = await asyncio.gather(
                    reconcile(self.store, dry_run=False), starting, return_exceptions=True
                )
                if isinstance(report, BaseException):
                    raise report
                self._check_report(report, racing=True)
                if isinstance(outcome, BaseException):
                    raise outcome
                return outcome

            try:
                result = loop.run(both())
            except RealmError as exc:
                codes = {"active": "STATE_RUN_ALREADY_ACTIVE", "used": "STATE_IDEMPOTENCY_KEY_USED",
                         "conflict": "STATE_IDEMPOTENCY_KEY_CONFLICT"}  # fmt: skip
                assert exc.code == codes[expected]
                return
            if expected == "existing":
                assert result.deduped and result.run_id == self.runs[key][-1][0]
                assert result.params_mismatch == (fp != self.runs[key][-1][3])
                return
            assert expected in ("start", "rerun") and not result.deduped
            if expected == "rerun":
                old = self.runs[key][-1]
                assert result.rerun_of == old[0]
                if old[1] == "running":  # cancel_existing ended it in the same script
                    old[1] = "cancelled"
            else:
                assert result.rerun_of is None
            self.runs[key].append([result.run_id, "running", 0, fp])

        @rule(dry_run=st.booleans())
        def repair(self, dry_run: bool) -> None:
            """Reconcile on a consistent store: it reports every key current, and its
            repair changes nothing (the invariant checks every pointer after it)."""
            self._reconcile(dry_run)

        def _reconcile(self, dry_run: bool) -> None:
            self._check_report(loop.run(reconcile(self.store, dry_run=dry_run)), racing=False)

        def _check_report(self, report: ReconcileReport, racing: bool) -> None:
            # A racing start may make the walk read a key mid-change: such a key is
            # left to the script, which finds it current (`moved`), never rewritten.
            assert (report.written, report.deleted, report.dangling, report.pruned) == (0, 0, 0, 0)
            if not racing:
                used = [k for k in KEYS if self.runs[k]]
                assert (report.groups, report.current, report.to_write) == (len(used), len(used), 0)
                assert report.duplicate_groups == sum(len(self.runs[k]) > 1 for k in used)
                assert report.moved == 0

        @rule(key=keys)
        def complete_current_step(self, key: str) -> None:
            if not self.runs[key]:
                return
            run = self.runs[key][-1]
            step = STEPS[min(run[2], len(STEPS) - 1)]
            try:
                result = loop.run(self.store.complete_step(run[0], step))
            except RealmError as exc:
                assert run[1] != "running" and exc.code == "STATE_RUN_NOT_LIVE"
                return
            assert run[1] == "running"
            run[2] += 1
            if run[2] == len(STEPS):
                run[1] = "completed"
                assert result.next_step is None
            else:
                assert result.next_step == STEPS[run[2]]

        @rule(key=keys)
        def fail(self, key: str) -> None:
            if not self.runs[key]:
                return
            run = self.runs[key][-1]
            try:
                loop.run(self.store.fail_run(run[0]))
            except RealmError as exc:
                assert run[1] != "running" and exc.code == "STATE_RUN_NOT_LIVE"
                return
            run[1] = "failed"

        @rule(key=keys, by_key=st.booleans())
        def cancel(self, key: str, by_key: bool) -> None:
            if not self.runs[key]:
                return
            run = self.runs[key][-1]
            if by_key:
                count = loop.run(self.store.cancel_key("sync", key))
            else:
                count = loop.run(self.store.cancel_run(run[0]))
            assert count == (1 if run[1] == "running" else 0)
            if count:
                run[1] = "cancelled"

        @invariant()
        def store_matches_model(self) -> None:
            sync = Keys("realm", "sync")
            for key in KEYS:
                if not self.runs[key]:
                    continue
                runs, _ = loop.run(self.store.list_runs("sync", key=key, limit=100))
                # At most one live run per key, and the key names the newest run.
                assert sum(r.phase == "running" for r in runs) <= 1
                assert [r.id for r in runs] == [r[0] for r in reversed(self.runs[key])]
                assert [r.phase for r in runs] == [r[1] for r in reversed(self.runs[key])]
                pointer = loop.run(client.hget(sync.pointer(key), "run"))
                assert pointer.decode() == self.runs[key][-1][0]

    try:
        run_machine = Model.TestCase
        run_machine.settings = settings(
            max_examples=60,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        )
        run_machine().runTest()
    finally:
        loop.run(client.aclose())
        loop.close()


async def _client(url: str):
    return redis_client(url, 10.0)
