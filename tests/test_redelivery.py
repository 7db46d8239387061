"""Promise 1 for keys shared by several events: a redelivered event starts nothing new.

A fixed or templated key is shared by *different* events on purpose; its policies
(cancel_existing, rerun, fail) decide between them. The same event delivered again
must get the run it got the first time, whatever those policies say.
These tests drive the store's claim with the markers the listener passes, against a
real Redis; tests at the end run a real `realm listen` on the shipped triggers.yaml.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.ingest.delivery import markers_for
from gateway.ingest.triggers import parse_triggers
from gateway.model.errors import ConfigError, RealmError
from gateway.store.runs import LIVE_MATCH, TERMINAL_MATCH
from gateway.store.runstore import RunStore
from tests.listener import Listener
from tests.servers import RedisServer
from tests.signing import github_headers

WF = "single"  # one step, `only`: completing it ends the run
KEY = "the-singleton"


async def start(store: RunStore, event: str, live: str, terminal: str, **kw):
    return await store.start_run(
        WF,
        {"event": event},
        KEY,
        live,  # type: ignore[arg-type]
        terminal,  # type: ignore[arg-type]
        markers=[store.event_marker(WF, "trigger", event)],
        **kw,
    )


async def run_count(store: RunStore) -> int:
    return int(await store.redis.zcard(store.keys(WF).runs()))


@pytest.mark.parametrize(("live", "terminal"), list(itertools.product(LIVE_MATCH, TERMINAL_MATCH)))
async def test_redelivery_while_live_gets_its_own_run_whatever_the_policy(
    store: RunStore, live: str, terminal: str
) -> None:
    first = await start(store, "evt-A", live, terminal)
    assert not first.deduped
    # Ten concurrent redeliveries of the same event: all get the first run, none
    # cancels, supersedes or refuses it.
    again = await asyncio.gather(*(start(store, "evt-A", live, terminal) for _ in range(10)))
    assert {(r.run_id, r.deduped, r.phase) for r in again} == {(first.run_id, True, "running")}
    assert await run_count(store) == 1

    # Another event meets the key while the run is live: the key's policy decides.
    if live == "fail":
        with pytest.raises(RealmError) as refused:
            await start(store, "evt-B", live, terminal)
        assert refused.value.code == "STATE_RUN_ALREADY_ACTIVE"
        other = None
    else:
        other = await start(store, "evt-B", live, terminal)
        if live == "use_existing":
            assert (other.run_id, other.deduped) == (first.run_id, True)
        elif live == "queue":
            assert (other.phase, other.deduped, other.rerun_of) == ("queued", False, None)
        else:
            assert other.rerun_of == first.run_id and not other.deduped
    # ...and a redelivery of the first event still gets exactly its own run.
    late = await start(store, "evt-A", live, terminal)
    assert late.run_id == first.run_id and late.deduped
    phase = "cancelled" if live == "cancel_existing" else "running"
    assert late.phase == phase
    if other is not None and live == "cancel_existing":
        # The replacement was not cancelled by the redelivery.
        assert (await store.get_run(other.run_id)).phase == "running"
    if other is not None and live == "queue":
        # Still waiting: the redelivery neither started nor moved it.
        assert (await store.get_run(other.run_id)).phase == "queued"
    assert await run_count(store) == (2 if live in ("cancel_existing", "queue") else 1)


@pytest.mark.parametrize(("live", "terminal"), list(itertools.product(LIVE_MATCH, TERMINAL_MATCH)))
async def test_redelivery_after_the_run_ended_gets_that_run_whatever_the_policy(
    store: RunStore, live: str, terminal: str
) -> None:
    first = await start(store, "evt-A", live, terminal)
    await store.complete_step(first.run_id, "only")
    again = await asyncio.gather(*(start(store, "evt-A", live, terminal) for _ in range(10)))
    assert {(r.run_id, r.deduped, r.phase) for r in again} == {(first.run_id, True, "completed")}
    assert await run_count(store) == 1

    # A different event after the end: the key's on_terminal_match decides.
    if terminal == "reject":
        with pytest.raises(RealmError) as refused:
            await start(store, "evt-B", live, terminal)
        assert refused.value.code == "STATE_IDEMPOTENCY_KEY_USED"
    else:
        other = await start(store, "evt-B", live, terminal)
        if terminal == "rerun":
            assert other.rerun_of == first.run_id and not other.deduped
        else:  # reuse, and rerun_if_failed after a completed run
            assert (other.run_id, other.deduped) == (first.run_id, True)


async def test_an_event_that_was_refused_is_decided_afresh_on_redelivery(store: RunStore) -> None:
    """A refusal started nothing, so it records nothing: the redelivery of a refused
    event is a new decision (how an operator retries work `fail` turned away)."""
    holder = await start(store, "evt-A", "fail", "rerun")
    with pytest.raises(RealmError):
        await start(store, "evt-B", "fail", "rerun")
    await store.complete_step(holder.run_id, "only")
    retried = await start(store, "evt-B", "fail", "rerun")
    assert not retried.deduped and retried.rerun_of == holder.run_id
    # From then on evt-B has its run, and keeps it.
    await store.complete_step(retried.run_id, "only")
    assert (await start(store, "evt-B", "fail", "rerun")).run_id == retried.run_id


async def test_a_marker_whose_run_is_gone_protects_nothing(store: RunStore) -> None:
    first = await start(store, "evt-A", "use_existing", "rerun")
    await store.complete_step(first.run_id, "only")
    await store.redis.delete(store.keys(WF).run(first.run_id))
    again = await start(store, "evt-A", "use_existing", "rerun")
    assert not again.deduped and again.run_id != first.run_id
    assert (await store.get_run(again.run_id)).phase == "running"


async def test_a_refused_start_leaves_no_marker_of_its_event(store: RunStore) -> None:
    """The claim places an absent marker as it reads it; a start that ends without a
    decision (a refusal, a repeat's need of the run's hash) takes it back."""
    await start(store, "evt-A", "fail", "reuse")
    with pytest.raises(RealmError):
        await start(store, "evt-B", "fail", "reuse")
    marker = store.keys(WF).event("trigger", "evt-B")
    assert await store.redis.exists(marker) == 0


async def test_a_marker_an_earlier_version_wrote_as_a_hash_still_deduplicates(
    store: RunStore,
) -> None:
    """Markers were hashes before they were strings: one written then, during an
    upgrade, still answers for its event, in the claim and in its preview; the next
    decision on that event writes it anew, as a string."""
    first = await start(store, "evt-A", "use_existing", "rerun")
    await store.complete_step(first.run_id, "only")
    marker = store.keys(WF).event("trigger", "evt-A")
    await store.redis.delete(marker)
    await store.redis.hset(
        marker, mapping={"run": first.run_id, "outcome": "created", "rerun_of": "", "tag": ""}
    )
    decision, state = await store.preview_start(
        WF, KEY, "use_existing", "rerun", "flag", "fp", [store.event_marker(WF, "trigger", "evt-A")]
    )
    assert (decision, state and state.run_id) == ("existing", first.run_id)
    again = await start(store, "evt-A", "use_existing", "rerun")
    assert (again.deduped, again.run_id) == (True, first.run_id)
    assert await run_count(store) == 1
    # A new event on the key reruns it; its marker is a string from the start.
    other = await start(store, "evt-B", "use_existing", "rerun")
    assert other.rerun_of == first.run_id
    assert await store.redis.type(store.keys(WF).event("trigger", "evt-B")) == b"string"


# ------------------------------------------------------------------ request ids


@pytest.mark.parametrize("terminal", TERMINAL_MATCH)
async def test_a_retried_request_gets_the_first_calls_result(
    store: RunStore, terminal: str
) -> None:
    first = await store.start_run(WF, {}, KEY, "cancel_existing", terminal, request_id="req-1")
    await store.complete_step(first.run_id, "only")
    retried = await store.start_run(WF, {}, KEY, "cancel_existing", terminal, request_id="req-1")
    # The first call started the run: so does its retry's answer, with the run's phase now.
    assert (retried.run_id, retried.deduped, retried.phase) == (first.run_id, False, "completed")
    assert await run_count(store) == 1


async def test_a_request_that_was_deduplicated_is_deduplicated_again(store: RunStore) -> None:
    owner = await store.start_run(WF, {}, KEY, "use_existing", "rerun")
    dup = await store.start_run(WF, {}, KEY, "use_existing", "rerun", request_id="req-2")
    assert dup.deduped and dup.run_id == owner.run_id
    await store.complete_step(owner.run_id, "only")
    # Without the request id this would rerun; its retry must not.
    retried = await store.start_run(WF, {}, KEY, "use_existing", "rerun", request_id="req-2")
    assert (retried.run_id, retried.deduped) == (owner.run_id, True)
    assert await run_count(store) == 1


async def test_concurrent_retries_of_a_keyless_request_start_one_run(store: RunStore) -> None:
    results = await asyncio.gather(
        *(store.start_run(WF, {"n": 1}, request_id="req-3") for _ in range(20))
    )
    assert len({r.run_id for r in results}) == 1
    assert await run_count(store) == 1


async def test_a_request_id_is_checked(store: RunStore) -> None:
    with pytest.raises(RealmError) as bad:
        await store.start_run(WF, {}, request_id="x" * 201)
    assert bad.value.code == "VALIDATION_PARAMS"
    assert "request_id" in bad.value.message


# ------------------------------------------------------------------ dangling pointers


@pytest.mark.parametrize("live", LIVE_MATCH)
async def test_a_pointer_to_a_run_that_no_longer_exists_frees_the_key(
    store: RunStore, live: str
) -> None:
    """A deleted or evicted run hash: the key is free. Before, cancel_existing looped
    until its deadline (then 503 forever) and use_existing deduplicated onto a 404."""
    gone = await store.start_run(WF, {}, KEY, live)  # type: ignore[arg-type]
    await store.redis.delete(store.keys(WF).run(gone.run_id))
    fresh = await store.start_run(WF, {}, KEY, live)  # type: ignore[arg-type]
    assert not fresh.deduped and fresh.run_id != gone.run_id and fresh.rerun_of is None
    assert (await store.get_run(fresh.run_id)).phase == "running"
    pointer = await store.redis.hget(store.keys(WF).pointer(KEY), "run")
    assert pointer.decode() == fresh.run_id


async def test_cancel_key_on_a_dangling_pointer_cancels_nothing_and_frees_the_key(
    store: RunStore,
) -> None:
    gone = await store.start_run(WF, {}, KEY)
    run_key = store.keys(WF).run(gone.run_id)
    await store.redis.delete(run_key)
    assert await store.cancel_key(WF, KEY) == 0
    assert not await store.redis.exists(run_key), "cancel wrote a zombie run hash"
    assert not await store.redis.exists(store.keys(WF).pointer(KEY))


# ------------------------------------------------------------------ end to end

ROOT = Path(__file__).resolve().parents[1]
SECRETS = {
    "GITHUB_WEBHOOK_SECRET": "e2e-github-secret",
    "STRIPE_WEBHOOK_SECRET": "whsec_ZTJlLXN0cmlwZS1zZWNyZXQ=",
    "REALM_TRIGGER_TOKEN": "e2e-trigger-token",
    "REALM_API_TOKEN": "e2e-api-token",
}


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServer):
    """A real `realm listen` serving the repository's own triggers.yaml."""
    workdir = tmp_path_factory.mktemp("shipped")
    listener = Listener(
        workdir, (ROOT / "triggers.yaml").read_text(), redis_url=module_redis.url, env=SECRETS
    ).start()
    yield listener
    listener.stop()


def token_delivery(client: httpx.Client, path: str, idempotency_key: str) -> httpx.Response:
    return client.post(
        path,
        content=b"{}",
        headers={
            "Content-Type": "application/json",
            "X-Realm-Token": SECRETS["REALM_TRIGGER_TOKEN"],
            "Idempotency-Key": idempotency_key,
        },
    )


@pytest.mark.parametrize("path", ["/hooks/rebuild-cache", "/hooks/nightly-sync"])
def test_shipped_singletons_deduplicate_a_redelivered_event(shipped: Listener, db, path) -> None:
    event = f"evt-{uuid.uuid4()}"
    with httpx.Client(base_url=shipped.base_url, timeout=10) as client:
        first = token_delivery(client, path, event)
        assert first.status_code == 202, first.text
        [started] = first.json()["results"]
        again = token_delivery(client, path, event)
        assert again.status_code == 200, again.text
        [result] = again.json()["results"]
        assert result["outcome"] == "deduplicated"
        assert result["run_id"] == started["run_id"] and result["rerun_of"] is None
        # The run ends; the event is delivered again (Stripe retries for days).
        workflow = path.rsplit("/", 1)[1]
        done = client.post(
            f"/v1/runs/{started['run_id']}/fail",
            json={"error": "ended for the test"},
            headers={"Authorization": f"Bearer {SECRETS['REALM_API_TOKEN']}"},
        )
        assert done.status_code == 200, done.text
        late = token_delivery(client, path, event)
        assert late.status_code == 200, late.text
        [result] = late.json()["results"]
        assert (result["outcome"], result["run_id"]) == ("deduplicated", started["run_id"])
        # A different event meets the ended singleton: on_terminal_match: rerun.
        other = token_delivery(client, path, f"evt-{uuid.uuid4()}")
        assert other.status_code == 202, other.text
        assert other.json()["results"][0]["rerun_of"] == started["run_id"]
    assert db.zcard(f"realm:{{{workflow}}}:runs") == 2


def test_a_captured_github_body_sent_with_a_new_delivery_id_starts_nothing(
    shipped: Listener, db
) -> None:
    body = json.dumps(
        {
            "ref": "refs/heads/main",
            "after": os.urandom(20).hex(),
            "repository": {"full_name": "acme/app"},
        }
    ).encode()
    secret = SECRETS["GITHUB_WEBHOOK_SECRET"]
    with httpx.Client(base_url=shipped.base_url, timeout=10) as client:
        first = client.post(
            "/hooks/github", content=body, headers=github_headers(body, secret, delivery="d-1")
        )
        assert first.status_code == 202, first.text
        run_id = first.json()["results"][0]["run_id"]
        replays = [
            client.post(
                "/hooks/github",
                content=body,
                headers=github_headers(body, secret, delivery=f"d-{n}"),
            )
            for n in range(2, 6)
        ]
    for replay in replays:
        assert replay.status_code == 200, replay.text
        [result] = [r for r in replay.json()["results"] if r["workflow"] == "deploy"]
        assert (result["outcome"], result["run_id"]) == ("deduplicated", run_id)
    assert db.zcard("realm:{deploy}:runs") == 1


# ------------------------------------------------------------------ the replay guard's setting


def _one_trigger(verify: str, extra: str = "") -> str:
    return f"""
t:
  workflow: deploy
  path: /hooks/x
  verify: {verify}
  event_id: {{header: X-Id}}
{extra}"""


@pytest.mark.parametrize(
    ("verify", "default"),
    [
        ("{scheme: github, secret_env: S}", True),
        ("{scheme: hmac, secret_env: S, header: X-Sig}", False),
        ("{scheme: token, secret_env: S, header: X-Token}", False),
        ("{scheme: none}", False),
    ],
)
def test_the_replay_guard_is_on_by_default_only_for_github(verify: str, default: bool) -> None:
    raw = yaml.safe_load(_one_trigger(verify))
    env = {"S": "secret"}
    trigger = parse_triggers(raw, file="t.yaml", workflows=("deploy",), env=env)["t"]
    assert trigger.replay_guard is default
    raw["t"]["replay_guard"] = not default
    flipped = parse_triggers(raw, file="t.yaml", workflows=("deploy",), env=env)["t"]
    assert flipped.replay_guard is not default


@pytest.mark.parametrize(
    ("verify", "value", "reason"),
    [
        ("{scheme: stripe, secret_env: S}", "true", "is not needed with scheme stripe"),
        ("{scheme: github, secret_env: S}", "yes please", "must be true or false"),
    ],
)
def test_a_wrong_replay_guard_is_refused(verify: str, value: str, reason: str) -> None:
    raw = yaml.safe_load(_one_trigger(verify, f"  replay_guard: {value}"))
    with pytest.raises(ConfigError) as refused:
        parse_triggers(raw, file="t.yaml", workflows=("deploy",), env={"S": "whsec_c2VjcmV0"})
    assert "replay_guard" in str(refused.value) and reason in str(refused.value)


@pytest.mark.parametrize(
    ("event_id", "guarded"), [("{header: X-Id}", True), ("{jsonpath: $.id}", False)]
)
def test_the_replay_guard_records_nothing_for_an_event_id_the_body_carries(
    store: RunStore, event_id: str, guarded: bool
) -> None:
    """A body seen again under another event id is what the guard catches. An event id
    read from the body is the same whenever the body is, so there the claim gets no
    body marker to read and write."""
    text = _one_trigger("{scheme: github, secret_env: S}").replace("{header: X-Id}", event_id)
    raw = yaml.safe_load(text)
    trigger = parse_triggers(raw, file="t.yaml", workflows=("deploy",), env={"S": "s"})["t"]
    assert trigger.replay_guard  # on, by default for github
    markers = markers_for(store, trigger, "evt-1", "ab" * 32)
    assert [m.mode for m in markers] == (["replay"] if guarded else [])
