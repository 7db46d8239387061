"""A request_id names one call: its resend gets the first call's answer, and the same
id sent with another run, step or kind of call is refused (409
STATE_REQUEST_ID_REUSED), never answered with what the first call did. Real Redis,
and a real `realm listen` for the HTTP API."""

from __future__ import annotations

from collections.abc import Awaitable, Iterator

import httpx
import pytest
import redis as redis_sync
from redis.asyncio import Redis

from gateway.loading import parse_config
from gateway.model.errors import RealmError
from gateway.store.runstore import RunStore
from tests.listener import Listener
from tests.servers import RedisServer

YAML = """
version: 1
workflows:
  job:
    steps: [fetch, build, ship]
    max_attempts: 3
    retention: 1h
"""
TOKEN = "test-api-token-request-ids"


@pytest.fixture
async def jobs(redis: Redis) -> RunStore:
    return RunStore(redis, parse_config(YAML, file="job.yaml", with_triggers=False), timeout=5.0)


async def _refused(call: Awaitable[object]) -> RealmError:
    with pytest.raises(RealmError) as refused:
        await call
    return refused.value


async def test_a_resend_with_the_same_id_gets_the_first_answer(jobs: RunStore) -> None:
    run = await jobs.start_run("job", {})
    first = await jobs.complete_step(run.run_id, "fetch", op_id="done-1")
    again = await jobs.complete_step(run.run_id, "fetch", op_id="done-1")
    assert first == again
    assert (await jobs.get_run(run.run_id)).step == "build", "recorded once"


async def test_an_id_reused_for_another_step_or_run_is_refused(jobs: RunStore) -> None:
    one = await jobs.start_run("job", {"n": 1})
    two = await jobs.start_run("job", {"n": 2})
    await jobs.complete_step(one.run_id, "fetch", op_id="r-1")

    other_step = await _refused(jobs.complete_step(one.run_id, "build", op_id="r-1"))
    assert other_step.code == "STATE_REQUEST_ID_REUSED"
    assert other_step.message == (
        f"This request_id already named another call (completing step 'fetch' of run "
        f"'{one.run_id}'); a request_id names one call: send this one with a new request_id."
    )
    other_run = await _refused(jobs.complete_step(two.run_id, "fetch", op_id="r-1"))
    assert other_run.code == "STATE_REQUEST_ID_REUSED"
    # Neither was acknowledged as done: both runs are where they were.
    assert (await jobs.get_run(one.run_id)).step == "build"
    assert (await jobs.get_run(two.run_id)).step == "fetch"


async def test_an_id_reused_for_another_kind_of_call_is_refused(jobs: RunStore) -> None:
    one = await jobs.start_run("job", {"n": 1})
    two = await jobs.start_run("job", {"n": 2})
    assert await jobs.cancel_run(one.run_id, op_id="c-1") == 1

    for call in (
        jobs.fail_run(two.run_id, "boom", op_id="c-1"),
        jobs.cancel_run(two.run_id, op_id="c-1"),
        jobs.complete_step(two.run_id, "fetch", op_id="c-1"),
    ):
        refused = await _refused(call)
        assert refused.code == "STATE_REQUEST_ID_REUSED"
        assert f"(cancelling run '{one.run_id}')" in refused.message
    assert (await jobs.get_run(two.run_id)).phase == "running"

    [taken] = await jobs.take_steps("job", "r1")
    assert taken.run_id == two.run_id
    await jobs.complete_step(two.run_id, "fetch", lease=taken.lease, op_id="s-1")
    [build] = await jobs.take_steps("job", "r1")
    refused = await _refused(jobs.fail_step(two.run_id, "build", "x", lease=build.lease,
                                            op_id="s-1"))  # fmt: skip
    assert refused.code == "STATE_REQUEST_ID_REUSED"
    assert (await jobs.get_run(two.run_id)).error is None, "the failure was not recorded"
    await jobs.cancel_key("job", "no-such-key", op_id="k-1")  # refused nothing: no record
    assert await jobs.cancel_run(two.run_id, op_id="k-1") == 1


# -- through the HTTP API -------------------------------------------------------------


@pytest.fixture(scope="module")
def listener(
    module_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Listener]:
    listener = Listener(
        tmp_path_factory.mktemp("request-ids"), YAML, redis_url=module_redis.url,
        env={"REALM_API_TOKEN": TOKEN},
    ).start()  # fmt: skip
    yield listener
    listener.stop()


@pytest.fixture
def api(listener: Listener, db: redis_sync.Redis) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=listener.base_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
    ) as client:
        yield client


def _start(api: httpx.Client) -> str:
    started = api.post("/v1/workflows/job/runs", json={})
    assert started.status_code == 202
    return started.json()["run_id"]


def test_the_api_refuses_a_reused_request_id_with_409(api: httpx.Client) -> None:
    one, two = _start(api), _start(api)
    done = api.post(f"/v1/runs/{one}/complete", json={"step": "fetch", "request_id": "a-1"})
    assert done.status_code == 200 and done.json()["next_step"] == "build"
    resent = api.post(f"/v1/runs/{one}/complete", json={"step": "fetch", "request_id": "a-1"})
    assert resent.json() == done.json(), "a resend gets the first answer"

    reused = api.post(f"/v1/runs/{two}/complete", json={"step": "fetch", "request_id": "a-1"})
    assert reused.status_code == 409
    assert reused.json() == {
        "status": "error",
        "code": "STATE_REQUEST_ID_REUSED",
        "message": f"This request_id already named another call (completing step 'fetch' of "
        f"run '{one}'); a request_id names one call: send this one with a new request_id.",
    }
    assert api.get(f"/v1/runs/{two}").json()["next_step"] == "fetch"


def test_the_api_refuses_an_id_reused_across_kinds_of_call(api: httpx.Client) -> None:
    one, two = _start(api), _start(api)
    assert api.post(f"/v1/runs/{one}/cancel", json={"request_id": "b-1"}).json() == {"cancelled": 1}
    for path, body in (
        (f"/v1/runs/{two}/fail", {"error": "boom", "request_id": "b-1"}),
        (f"/v1/runs/{two}/complete", {"step": "fetch", "request_id": "b-1"}),
        (f"/v1/runs/{two}/cancel", {"request_id": "b-1"}),
    ):
        reply = api.post(path, json=body)
        assert reply.status_code == 409, (path, reply.text)
        assert reply.json()["code"] == "STATE_REQUEST_ID_REUSED"
        assert f"(cancelling run '{one}')" in reply.json()["message"]
    assert api.get(f"/v1/runs/{two}").json()["phase"] == "running"
