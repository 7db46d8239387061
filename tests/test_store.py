"""The run store against a real server: every cell of the policy table, races, NOSCRIPT,
retention."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.asyncio import Redis

from gateway.deliveries.log import Received, list_deliveries, write_records
from gateway.ingest.delivery import error_reply
from gateway.model.config import Config, IngressLimit
from gateway.model.errors import RealmError
from gateway.store.ingress import ingress_wait_us
from gateway.store.keys import Keys
from gateway.store.reconcile import reconcile
from gateway.store.runs import Flow
from gateway.store.runstore import RunStore
from gateway.store.scripts import SCRIPT_NAMES
from gateway.store.sweep import start_due, sweep

KEYS = Keys("realm", "sync")


async def stream_entries(redis: Redis, workflow: str = "sync") -> list[dict[bytes, bytes]]:
    return [fields for _, fields in await redis.xrange(Keys("realm", workflow).stream())]


async def pointer_run(redis: Redis, key: str) -> str:
    return (await redis.hget(KEYS.pointer(key), "run")).decode()


# -- first start and plain repeats --------------------------------------------------------


async def test_first_start_creates_a_run_queued_for_its_first_step(store: RunStore, redis: Redis):
    result = await store.start_run("sync", {"order": 4417}, "order-4417")

    assert result.deduped is False
    assert result.phase == "running"
    assert result.next_step == "fetch"
    assert result.rerun_of is None
    uuid.UUID(result.run_id)
    entries = await stream_entries(redis)
    assert entries == [
        {
            b"run_id": result.run_id.encode(),
            b"workflow": b"sync",
            b"step": b"fetch",
            b"params": b'{"order":4417}',
        }
    ]
    run = await store.get_run(result.run_id)
    assert (run.key, run.phase, run.step, dict(run.params)) == (
        "order-4417",
        "running",
        "fetch",
        {"order": 4417},
    )
    assert await pointer_run(redis, "order-4417") == result.run_id


async def test_repeat_while_live_use_existing_returns_the_live_run(store: RunStore, redis: Redis):
    first = await store.start_run("sync", {}, "k")
    again = await store.start_run("sync", {}, "k", on_live_match="use_existing")

    assert again.deduped is True
    assert again.run_id == first.run_id
    assert (again.phase, again.next_step) == ("running", "fetch")
    assert len(await stream_entries(redis)) == 1


async def test_repeat_while_live_fail_is_refused(store: RunStore):
    first = await store.start_run("sync", {}, "k")
    with pytest.raises(RealmError) as err:
        await store.start_run("sync", {}, "k", on_live_match="fail")

    assert err.value.code == "STATE_RUN_ALREADY_ACTIVE"
    assert err.value.message == (
        f"Idempotency key for workflow 'sync' is owned by an active run '{first.run_id}' "
        "(phase 'running')."
    )


async def test_repeat_while_live_cancel_existing_replaces_the_run_in_one_step(
    store: RunStore, redis: Redis
):
    first = await store.start_run("sync", {}, "k")
    second = await store.start_run("sync", {}, "k", on_live_match="cancel_existing")

    assert second.deduped is False
    assert second.run_id != first.run_id
    assert second.rerun_of == first.run_id
    assert second.superseded_by == "on_live_match"
    assert (await store.get_run(first.run_id)).phase == "cancelled"
    assert (await store.get_run(second.run_id)).rerun_of == first.run_id
    assert await pointer_run(redis, "k") == second.run_id
    assert [e[b"run_id"].decode() for e in await stream_entries(redis)] == [
        first.run_id,
        second.run_id,
    ]
    # The cancelled run now ages out; the new live run and its pointer do not.
    assert await redis.pttl(KEYS.run(first.run_id)) > 0
    assert await redis.pttl(KEYS.run(second.run_id)) == -1
    assert await redis.pttl(KEYS.pointer("k")) == -1


async def test_cancel_existing_while_nothing_is_live_starts_normally(store: RunStore):
    result = await store.start_run("sync", {}, "k", on_live_match="cancel_existing")
    assert (result.deduped, result.rerun_of) == (False, None)


async def _ended(store: RunStore, how: str) -> str:
    run = await store.start_run("sync", {}, "k")
    if how == "completed":
        for step in ("fetch", "transform", "load"):
            await store.complete_step(run.run_id, step)
    elif how == "failed":
        await store.fail_run(run.run_id, "boom")
    else:
        assert await store.cancel_run(run.run_id) == 1
    assert (await store.get_run(run.run_id)).phase == how
    return run.run_id


@pytest.mark.parametrize("how", ["completed", "failed", "cancelled"])
async def test_repeat_after_end_reuse_returns_the_ended_run(store: RunStore, how: str):
    old = await _ended(store, how)
    again = await store.start_run("sync", {}, "k", on_terminal_match="reuse")

    assert (again.deduped, again.run_id, again.phase, again.next_step) == (True, old, how, None)


@pytest.mark.parametrize("how", ["completed", "failed", "cancelled"])
async def test_repeat_after_end_reject_is_refused(store: RunStore, how: str):
    old = await _ended(store, how)
    with pytest.raises(RealmError) as err:
        await store.start_run("sync", {}, "k", on_terminal_match="reject")

    assert err.value.code == "STATE_IDEMPOTENCY_KEY_USED"
    assert old in err.value.message


@pytest.mark.parametrize(
    ("how", "reruns"), [("completed", False), ("failed", True), ("cancelled", True)]
)
async def test_repeat_after_end_rerun_if_failed(
    store: RunStore, redis: Redis, how: str, reruns: bool
):
    old = await _ended(store, how)
    again = await store.start_run("sync", {}, "k", on_terminal_match="rerun_if_failed")

    if reruns:
        assert (again.deduped, again.rerun_of, again.phase) == (False, old, "running")
        assert await pointer_run(redis, "k") == again.run_id
    else:
        assert (again.deduped, again.run_id, again.phase) == (True, old, "completed")
        assert await pointer_run(redis, "k") == old


@pytest.mark.parametrize("how", ["completed", "failed", "cancelled"])
async def test_repeat_after_end_rerun_always_starts_a_new_run_with_lineage(
    store: RunStore, redis: Redis, how: str
):
    old = await _ended(store, how)
    again = await store.start_run("sync", {}, "k", on_terminal_match="rerun")

    assert (again.deduped, again.rerun_of, again.superseded_by) == (
        False,
        old,
        "on_terminal_match",
    )
    assert (await store.get_run(again.run_id)).rerun_of == old
    assert (await store.get_run(old)).phase == how, "the old run stays in the store"
    assert await pointer_run(redis, "k") == again.run_id
    # The key is live again: its pointer and run list lose their TTL.
    assert await redis.pttl(KEYS.pointer("k")) == -1
    assert await redis.pttl(KEYS.key_runs("k")) == -1
    runs, _ = await store.list_runs("sync", key="k")
    assert [r.id for r in runs] == [again.run_id, old]


@pytest.mark.parametrize("live", ["use_existing", "fail", "cancel_existing"])
@pytest.mark.parametrize("terminal", ["reuse", "reject", "rerun_if_failed", "rerun"])
async def test_terminal_policy_does_not_apply_while_live_and_vice_versa(
    store: RunStore, live: str, terminal: str
):
    """On a live run only on_live_match decides, whatever on_terminal_match says."""
    first = await store.start_run("sync", {}, "k")
    try:
        again = await store.start_run("sync", {}, "k", live, terminal)  # type: ignore[arg-type]
    except RealmError as exc:
        assert (live, exc.code) == ("fail", "STATE_RUN_ALREADY_ACTIVE")
        return
    if live == "use_existing":
        assert (again.deduped, again.run_id) == (True, first.run_id)
    else:
        assert (again.deduped, again.rerun_of) == (False, first.run_id)


async def test_a_start_without_key_always_starts_a_new_run(store: RunStore, redis: Redis):
    a = await store.start_run("sync", {})
    b = await store.start_run("sync", {})
    assert a.run_id != b.run_id
    assert not a.deduped and not b.deduped
    assert len(await stream_entries(redis)) == 2


async def test_the_same_key_under_another_workflow_is_another_key(store: RunStore):
    a = await store.start_run("sync", {}, "shared")
    b = await store.start_run("single", {}, "shared")
    assert a.run_id != b.run_id and not b.deduped


async def test_params_mismatch_is_flagged_or_refused(store: RunStore):
    first = await store.start_run("sync", {"n": 1}, "k")
    same = await store.start_run("sync", {"n": 1}, "k")
    differs = await store.start_run("sync", {"n": 2}, "k")
    assert same.params_mismatch is False
    assert (differs.deduped, differs.run_id, differs.params_mismatch) == (
        True,
        first.run_id,
        True,
    )
    with pytest.raises(RealmError) as err:
        await store.start_run("sync", {"n": 2}, "k", on_params_mismatch="reject")
    assert err.value.code == "STATE_IDEMPOTENCY_KEY_CONFLICT"


async def test_singleton_keep_the_running_one_then_rerun_after_it_ended(store: RunStore):
    """Upstash's 'keep the running one': fail while live, a fresh run once it ended."""
    policies = {"on_live_match": "fail", "on_terminal_match": "rerun"}
    first = await store.start_run("single", {"source": "crm"}, "nightly", **policies)
    with pytest.raises(RealmError):
        await store.start_run("single", {"source": "crm"}, "nightly", **policies)
    await store.complete_step(first.run_id, "only")
    second = await store.start_run("single", {"source": "crm"}, "nightly", **policies)
    assert (second.deduped, second.rerun_of) == (False, first.run_id)


# -- steps, failing, cancelling -------------------------------------------------------------


async def test_complete_step_walks_the_steps_then_completes(store: RunStore, redis: Redis):
    run = await store.start_run("sync", {"a": 1}, "k")
    r1 = await store.complete_step(run.run_id, "fetch")
    r2 = await store.complete_step(run.run_id, "transform")
    r3 = await store.complete_step(run.run_id, "load")

    assert [(r.phase, r.next_step) for r in (r1, r2, r3)] == [
        ("running", "transform"),
        ("running", "load"),
        ("completed", None),
    ]
    assert [e[b"step"] for e in await stream_entries(redis)] == [b"fetch", b"transform", b"load"]
    again = await store.start_run("sync", {"a": 1}, "k")
    assert (again.deduped, again.phase) == (True, "completed")


async def test_completing_a_step_that_is_not_current_is_refused(store: RunStore):
    run = await store.start_run("sync", {})
    with pytest.raises(RealmError) as err:
        await store.complete_step(run.run_id, "load")
    assert err.value.code == "STATE_STEP_NOT_CURRENT"
    assert (await store.get_run(run.run_id)).step == "fetch"


@pytest.mark.parametrize("how", ["completed", "failed", "cancelled"])
async def test_a_step_result_for_an_ended_run_is_refused(store: RunStore, how: str):
    old = await _ended(store, how)
    with pytest.raises(RealmError) as err:
        await store.complete_step(old, "fetch")
    assert err.value.code == "STATE_RUN_NOT_LIVE"
    with pytest.raises(RealmError) as err:
        await store.fail_run(old)
    assert err.value.code == "STATE_RUN_NOT_LIVE"
    assert (await store.get_run(old)).phase == how


async def test_cancel_reports_1_then_0_and_never_errors_on_an_ended_run(store: RunStore):
    run = await store.start_run("sync", {})
    assert await store.cancel_run(run.run_id) == 1
    assert await store.cancel_run(run.run_id) == 0
    done = await _ended(store, "completed")
    assert await store.cancel_run(done) == 0


async def test_cancel_key_cancels_the_live_run_of_the_key(store: RunStore):
    run = await store.start_run("sync", {}, "k")
    assert await store.cancel_key("sync", "k") == 1
    assert (await store.get_run(run.run_id)).phase == "cancelled"
    assert await store.cancel_key("sync", "k") == 0
    assert await store.cancel_key("sync", "no-such-key") == 0


async def test_fail_records_the_error(store: RunStore):
    run = await store.start_run("sync", {})
    failed = await store.fail_run(run.run_id, "upstream 500")
    assert (failed.phase, failed.error) == ("failed", "upstream 500")


# -- bad input -----------------------------------------------------------------------------


async def test_params_are_validated_before_any_redis_call(store: RunStore, redis: Redis):
    with pytest.raises(RealmError) as err:
        await store.start_run("deploy", {"repo": "o/r", "sha": "NOT-HEX"}, "k")
    assert err.value.code == "VALIDATION_PARAMS"
    assert "$.sha" in err.value.message and "does not match" in err.value.message
    with pytest.raises(RealmError) as err:
        await store.start_run("deploy", {"repo": "o/r"}, "k")
    assert "'sha' is a required property" in err.value.message
    assert await redis.dbsize() == 0


async def test_unknown_workflow_and_run(store: RunStore):
    with pytest.raises(RealmError) as err:
        await store.start_run("nope", {})
    assert err.value.code == "NOT_FOUND_WORKFLOW"
    assert "'nope'" in err.value.message
    with pytest.raises(RealmError) as err:
        await store.get_run(str(uuid.uuid4()))
    assert err.value.code == "NOT_FOUND_RUN"
    with pytest.raises(RealmError) as err:
        await store.cancel_run("not-a-uuid")
    assert err.value.code == "NOT_FOUND_RUN"


# -- races ---------------------------------------------------------------------------------


async def test_50_concurrent_identical_starts_make_exactly_one_run(
    redis_server, config: Config, redis: Redis
):
    from gateway.link.connection import redis_client

    # A pool of real connections, so the 50 calls truly overlap at the server.
    client = redis_client(redis_server.url, 5.0)
    store = RunStore(client, config, timeout=10)
    try:
        results = await asyncio.gather(
            *(store.start_run("sync", {"x": 1}, "race") for _ in range(50))
        )
    finally:
        await client.aclose()

    assert len({r.run_id for r in results}) == 1
    assert sum(not r.deduped for r in results) == 1
    assert len(await stream_entries(redis)) == 1
    assert await redis.zcard(KEYS.runs()) == 1


async def test_50_concurrent_cancel_existing_leave_one_live_run(store: RunStore, redis: Redis):
    await asyncio.gather(
        *(store.start_run("sync", {}, "k", on_live_match="cancel_existing") for _ in range(50))
    )
    runs, _ = await store.list_runs("sync", key="k", limit=100)
    assert len(runs) == 50
    assert [r.phase for r in runs].count("running") == 1
    live = next(r for r in runs if r.phase == "running")
    assert await pointer_run(redis, "k") == live.id == runs[0].id


# -- NOSCRIPT, retries, retention, key layout ----------------------------------------------


async def test_script_flush_between_calls_changes_nothing_a_caller_sees(
    store: RunStore, redis: Redis
):
    first = await store.start_run("sync", {}, "k")
    await redis.script_flush()
    again = await store.start_run("sync", {}, "k")
    await redis.script_flush()
    step = await store.complete_step(first.run_id, "fetch")
    await redis.script_flush()
    assert await store.cancel_key("sync", "k") == 1

    assert (again.deduped, again.run_id) == (True, first.run_id)
    assert step.next_step == "transform"


async def test_a_retried_start_that_already_committed_reports_its_own_run(store: RunStore):
    """The caller passes the new run's id; a retry after a lost reply still wins."""
    run_id = str(uuid.uuid4())
    first = await store.start_run("sync", {}, "k", run_id=run_id)
    retry = await store.start_run("sync", {}, "k", run_id=run_id)
    other = await store.start_run("sync", {}, "k")
    assert (first.deduped, retry.deduped, retry.run_id) == (False, False, run_id)
    assert (other.deduped, other.run_id) == (True, run_id)


async def test_ended_runs_and_their_pointers_expire_live_runs_never(store: RunStore, redis: Redis):
    live = await store.start_run("sync", {}, "live")
    done = await store.start_run("sync", {}, "done")
    await store.fail_run(done.run_id)
    single = await store.start_run("single", {}, "s")
    await store.cancel_run(single.run_id)

    assert await redis.pttl(KEYS.run(live.run_id)) == -1
    assert await redis.pttl(KEYS.pointer("live")) == -1
    two_hours = 2 * 3600 * 1000
    for name in (KEYS.run(done.run_id), KEYS.pointer("done"), KEYS.key_runs("done")):
        assert two_hours - 5000 < await redis.pttl(name) <= two_hours
    ninety_minutes = 90 * 60 * 1000
    assert (
        ninety_minutes - 5000
        < await redis.pttl(Keys("realm", "single").run(single.run_id))
        <= ninety_minutes
    )


def _received() -> Received:
    """A refused delivery, as the delivery log records it."""
    return Received(1, "/hooks/x", error_reply(401, "AUTH_REQUIRED", "no"), 1.0, "v", [])


async def test_every_key_a_script_touches_shares_one_cluster_slot(
    store: RunStore, redis: Redis, monkeypatch: pytest.MonkeyPatch
):
    """Record the KEYS of every script call and check each call's slots agree."""
    from redis.crc import key_slot

    seen: list[tuple[str, list[str]]] = []
    for name in SCRIPT_NAMES:
        script = getattr(store.scripts, name)
        original = script.__call__

        def spy(keys, args, *rest, _name=name, _orig=original, **kw):
            seen.append((_name, list(keys)))
            return _orig(keys, args, *rest, **kw)

        monkeypatch.setattr(script, "__call__", spy, raising=False)
        monkeypatch.setattr(store.scripts, name, _Spy(script, spy))

    a = await store.start_run("sync", {}, "k")
    await store.start_run("sync", {}, "k", on_live_match="cancel_existing")
    await store.start_run("sync", {})
    q = await store.start_run("sync", {}, "q", on_live_match="queue")
    await store.start_run("sync", {}, "q", on_live_match="queue")
    await store.cancel_run(q.run_id)  # starts the queued one
    await store.start_run("sync", {}, "d", flow=Flow(delay_ms=1))
    await start_due(store, "sync")
    b = await store.start_run("deploy", {"repo": "o/r", "sha": "abcdef0"}, "{weird}:key")
    await store.complete_step(b.run_id, "fetch")
    await store.fail_run(b.run_id)
    await store.cancel_run(a.run_id)
    await store.cancel_key("sync", "k")
    await store.start_run_batch("sync", [{"idempotency_key": "k"}, {"idempotency_key": "j"}, {}],
                                on_live_match="cancel_existing")  # fmt: skip
    await store.start_run_batch("sync", [{"idempotency_key": "k"}], on_live_match="cancel_existing")
    await redis.delete(KEYS.pointer("j"))
    await reconcile(store, dry_run=False)
    await sweep(store, "sync")
    [taken] = await store.take_steps("sync", "r1")
    await store.extend_lease(taken.run_id, taken.step, taken.lease)
    await store.fail_step(taken.run_id, taken.step, "boom", lease=taken.lease)
    await write_records(store, store.config.settings, [_received()])
    await list_deliveries(store)
    await ingress_wait_us(store, "/hooks/x", IngressLimit(count=1, period_ms=1_000, burst=1))

    assert {name for name, _ in seen} == set(SCRIPT_NAMES)
    for name, keys in seen:
        slots = {key_slot(k.encode()) for k in keys}
        assert len(slots) == 1, (name, keys)


class _Spy:
    def __init__(self, script, call):
        self.script = script.script
        self._call = call

    def __call__(self, keys, args, *rest, **kw):
        return self._call(keys, args, *rest, **kw)


# -- pipelined starts (the listener's mode) ------------------------------------------------


@pytest.fixture
async def pipelined(redis_server, config: Config):
    from gateway.link.connection import redis_client

    client = redis_client(redis_server.url, 5.0)
    store = RunStore(client, config, timeout=10, pipelined=True)
    yield store
    store.close()
    await client.aclose()


async def test_pipelined_concurrent_starts_keep_every_outcome_apart(pipelined, redis: Redis):
    await pipelined.start_run("sync", {}, "busy", on_live_match="fail")
    calls = [pipelined.start_run("sync", {}, f"k{i % 20}") for i in range(100)]
    calls.append(pipelined.start_run("sync", {}, "busy", on_live_match="fail"))
    results = await asyncio.gather(*calls, return_exceptions=True)

    refused = results.pop()
    assert isinstance(refused, RealmError) and refused.code == "STATE_RUN_ALREADY_ACTIVE"
    assert sum(not r.deduped for r in results) == 20
    by_key: dict[str, set[str]] = {}
    for i, r in enumerate(results):
        by_key.setdefault(f"k{i % 20}", set()).add(r.run_id)
    assert all(len(ids) == 1 for ids in by_key.values())
    assert await redis.xlen(KEYS.stream()) == 21


async def test_pipelined_starts_survive_a_script_flush(pipelined, redis: Redis):
    first = await pipelined.start_run("sync", {}, "k")
    await redis.script_flush()
    results = await asyncio.gather(*(pipelined.start_run("sync", {}, "k") for _ in range(30)))
    assert {r.run_id for r in results} == {first.run_id}
    assert all(r.deduped for r in results)
