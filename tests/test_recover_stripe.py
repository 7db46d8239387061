"""`realm recover stripe` as a user runs it: a real process, against a stand-in of
Stripe's events API on loopback (tests/sender_apis.py), claiming into a real Redis that
a real `realm listen` serves."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from tests.listener import Listener
from tests.sender_apis import StripeApi, retry_after, serve
from tests.servers import RedisServer
from tests.signing import stripe_headers

KEY = "sk_test_recoverKey51c2d0e9f8a7b6c5"
WEBHOOK_SECRET = "whsec_recover_test_9f8e7d"
# The key is an event id, and a body that differs under it is refused (409): how an
# event that did arrive looks to the command, whose body is its own serialisation.
CONFIG = r"""
version: 1
workflows:
  billing-sync:
    steps: [fetch, sync]
    params_schema:
      type: object
      required: [event_type, customer]
      properties:
        customer: {type: string}
triggers:
  stripe-billing:
    workflow: billing-sync
    path: /hooks/stripe
    verify: {scheme: stripe, secret_env: STRIPE_SECRET}
    when: [{jsonpath: $.type, matches: '^invoice\.'}]
    event_id: {jsonpath: $.id}
    params: {event_type: $.type, customer: $.data.object.customer}
    on_params_mismatch: reject
"""
INVOICE = (Path(__file__).parent / "payloads" / "stripe" / "invoice.paid.json").read_text()
RUNS = "realm:{billing-sync}:runs"
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


def event(n: int, ago: float, kind: str = "invoice.paid", **data: Any) -> dict[str, Any]:
    """An event of its own, created ``ago`` seconds ago."""
    doc = json.loads(INVOICE)
    doc.update(id=f"evt_recover{n:04d}", type=kind, created=int(time.time() - ago))
    doc["data"]["object"].update(data)
    return doc


def iso(epoch: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


@pytest.fixture(scope="module")
def listener(
    module_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Listener]:
    started = Listener(
        tmp_path_factory.mktemp("recover-stripe"), CONFIG, redis_url=module_redis.url,
        env={"STRIPE_SECRET": WEBHOOK_SECRET},
    ).start()  # fmt: skip
    yield started
    started.stop()


@pytest.fixture
def stripe(db: redis.Redis) -> Iterator[StripeApi]:
    """The account's events, two to a page."""
    api = StripeApi(KEY, max_page=2)
    with serve(api):
        yield api


class Recover:
    """Runs `realm recover stripe ...` on the listener's config and Redis, with
    STRIPE_API_KEY and no webhook secret in the environment (none is needed)."""

    def __init__(self, listener: Listener, redis_url: str) -> None:
        self.config = listener.config_path
        self.redis_url = redis_url

    def __call__(
        self, api: StripeApi, *args: str, key: str | None = KEY
    ) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("REALM_")}
        for name in ("STRIPE_SECRET", "STRIPE_API_KEY"):
            env.pop(name, None)
        if key is not None:
            env["STRIPE_API_KEY"] = key
        return subprocess.run(
            [sys.executable, "-m", "gateway", "recover", "stripe", "--api-url", api.url,
             "--config", str(self.config), "--redis-url", self.redis_url, *args],
            cwd=self.config.parent, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip


@pytest.fixture
def recover(listener: Listener, module_redis: RedisServer) -> Recover:
    return Recover(listener, module_redis.url)


def no_secret(out: subprocess.CompletedProcess) -> None:
    assert KEY not in out.stdout + out.stderr
    assert WEBHOOK_SECRET not in out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr


@pytest.mark.slow
def test_each_missing_event_starts_one_run_and_a_second_run_starts_none(
    stripe: StripeApi, recover: Recover, listener: Listener, db: redis.Redis
) -> None:
    # Arrived, signed, as Stripe sent it: the listener started its run.
    arrived = event(1, 3000)
    body = json.dumps(arrived, indent=2).encode()
    reply = httpx.post(
        listener.base_url + "/hooks/stripe", content=body,
        headers=stripe_headers(body, WEBHOOK_SECRET),
    )  # fmt: skip
    assert reply.status_code == 202, reply.text
    stripe.add(arrived)
    missing = [stripe.add(event(n, 3000 - 100 * n)) for n in (2, 3, 4)]
    stripe.add(event(5, 2500, kind="charge.refunded"))
    stripe.add(event(6, 2400, customer=None))  # its params fail the schema
    stripe.add(event(7, 2300), delivered=True)  # Stripe delivered it: not listed
    stripe.add(event(8, 3 * 3600))  # older than --since 2h: not listed
    assert db.zcard(RUNS) == 1

    out = recover(stripe)
    assert out.returncode == 0, out.stdout + out.stderr
    no_secret(out)
    lines = out.stdout.splitlines()
    assert len(lines) == 5, out.stdout
    for line, sent in zip(lines[:3], missing, strict=True):
        assert re.fullmatch(
            rf"started  {sent['id']}  invoice\.paid  -  {iso(sent['created'])}  "
            rf"stripe-billing: run {UUID}",
            line,
        ), line
    assert lines[3].startswith(
        f"refused  evt_recover0006  invoice.paid  -  {iso(stripe.events[5][0]['created'])}  "
        "stripe-billing: VALIDATION_PARAMS: "
    ), lines[3]
    assert lines[4] == (
        "examined 6 events: 1 already here, 1 not matched, 1 refused, 3 started, 0 failed"
    )
    assert db.zcard(RUNS) == 4
    # Three pages of two: newest first, each after the last id of the one before.
    pages = stripe.calls_to("GET", "/v1/events")
    since = int(pages[0].query["created[gte]"])
    assert abs(since - (time.time() - 7200)) < 60
    first = {"limit": "100", "created[gte]": str(since), "delivery_success": "false"}
    assert [c.query for c in pages] == [
        first,
        {**first, "starting_after": "evt_recover0005"},
        {**first, "starting_after": "evt_recover0003"},
    ]

    # The one that arrived: its body differs from the command's serialisation, and
    # the trigger refuses another body under a used event id.
    (item,) = [i for i in json.loads(recover(stripe, "--json", "--dry-run").stdout)["items"]
               if i["id"] == arrived["id"]]  # fmt: skip
    assert item["outcome"] == "already_here"
    assert re.fullmatch(
        rf"stripe-billing: a claim would refuse: STATE_IDEMPOTENCY_KEY_CONFLICT \(run {UUID} "
        r"has other params\)",
        item["why"],
    ), item

    again = recover(stripe)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.splitlines()[1:] == [
        "examined 6 events: 4 already here, 1 not matched, 1 refused, 0 started, 0 failed"
    ]
    assert db.zcard(RUNS) == 4


def test_a_dry_run_prints_what_it_would_start_and_starts_nothing(
    stripe: StripeApi, recover: Recover, db: redis.Redis
) -> None:
    first, second = stripe.add(event(1, 600)), stripe.add(event(2, 300))
    out = recover(stripe, "--dry-run")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines() == [
        f"would start  evt_recover0001  invoice.paid  -  {iso(first['created'])}  "
        "stripe-billing: would start a new run",
        f"would start  evt_recover0002  invoice.paid  -  {iso(second['created'])}  "
        "stripe-billing: would start a new run",
        "dry run: examined 2 events: 0 already here, 0 not matched, 0 refused, 2 to start, "
        "0 failed",
    ]
    as_json = json.loads(recover(stripe, "--dry-run", "--json").stdout)
    assert (as_json["to_start"], as_json["examined"], as_json["failed"]) == (2, 2, 0)
    assert db.zcard(RUNS) == 0
    # Not even the workflows' layout is recorded by a dry run.
    assert list(db.scan_iter()) == []


def test_an_event_claimed_by_an_earlier_handle_is_already_here(
    stripe: StripeApi, recover: Recover, db: redis.Redis
) -> None:
    # A delivery whose bytes are exactly the command's own serialisation: the
    # claim deduplicates it instead of refusing it.
    claimed = event(1, 600)
    body = orjson.dumps(claimed)
    out = subprocess.run(
        [sys.executable, "-c", HANDLE, str(recover.config), recover.redis_url],
        input=body, capture_output=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode().strip() == "202"
    stripe.add(claimed)

    done = recover(stripe)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        "examined 1 event: 1 already here, 0 not matched, 0 refused, 0 started, 0 failed"
    ]
    assert db.zcard(RUNS) == 1


# The request path called as the listener calls it, with the delivery's signature
# already checked (on_arrival clears the trigger).
HANDLE = """
import asyncio, sys
from gateway.ingest.delivery import handle
from gateway.ingest.served import triggers_by_path
from gateway.ingest.webhooks import RequestHeaders
from gateway.link.connection import redis_client
from gateway.loading import load_config_without_secrets
from gateway.store.runstore import RunStore

async def main():
    config = load_config_without_secrets(sys.argv[1])
    client = redis_client(sys.argv[2], 5.0)
    store = RunStore(client, config)
    await store.check_layout(record=True)
    triggers = triggers_by_path(config)["/hooks/stripe"]
    headers = RequestHeaders([(b"content-type", b"application/json")])
    reply = await handle(store, triggers, headers, "application/json", sys.stdin.buffer.read(),
                         on_arrival={t.name: None for t in triggers})
    print(reply.status)
    await client.aclose()

asyncio.run(main())
"""


@pytest.mark.slow
def test_rate_limit_replies_are_waited_out_unless_stripe_says_not_to_retry(
    stripe: StripeApi, recover: Recover, db: redis.Redis
) -> None:
    stripe.add(event(1, 600))
    stripe.answer_next(retry_after(1, **{"Stripe-Should-Retry": "true"}), times=2)
    out = recover(stripe)
    assert out.returncode == 0, out.stdout + out.stderr
    found = re.fullmatch(
        r"examined 1 event: 0 already here, 0 not matched, 0 refused, 1 started, 0 failed; "
        r"waited out 2 rate-limit replies \((\d+\.\d) s\)",
        out.stdout.splitlines()[-1],
    )
    assert found and float(found.group(1)) == 2.0, out.stdout
    assert [c.status for c in stripe.calls] == [429, 429, 200]

    stripe.answer_next(retry_after(None, **{"Stripe-Should-Retry": "false"}))
    refused = recover(stripe)
    assert refused.returncode == 1
    assert refused.stderr.splitlines()[-1] == (
        "error: Stripe answered 429 to GET /v1/events: You have exceeded a secondary rate limit."
    )
    assert refused.stdout.splitlines() == [
        "examined 0 events: 0 already here, 0 not matched, 0 refused, 0 started, 0 failed"
    ]
    assert db.zcard(RUNS) == 1


def test_include_delivered_looks_at_the_events_stripe_delivered_too(
    stripe: StripeApi, recover: Recover, db: redis.Redis
) -> None:
    # Answered 202 by a node that was lost with its spool: Stripe counts it delivered.
    stripe.add(event(1, 600), delivered=True)
    plain = recover(stripe)
    assert plain.stdout.splitlines()[-1].startswith("examined 0 events: ")
    out = recover(stripe, "--include-delivered")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[-1] == (
        "examined 1 event: 0 already here, 0 not matched, 0 refused, 1 started, 0 failed"
    )
    assert "delivery_success" not in stripe.calls[-1].query
    assert db.zcard(RUNS) == 1


def test_no_key_is_a_usage_error_that_calls_nothing(stripe: StripeApi, recover: Recover) -> None:
    out = recover(stripe, key=None)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == (
        "error: STRIPE_API_KEY is not set: `realm recover stripe` needs it to call the "
        "sender's API (see docs/recover.md for what it must allow)\n"
    )
    assert stripe.calls == []


def test_a_key_stripe_refuses_is_named_and_never_shown(
    stripe: StripeApi, recover: Recover, db: redis.Redis
) -> None:
    stripe.add(event(1, 600))
    wrong = "sk_test_wrongKey0000aaaabbbbcccc"
    out = recover(stripe, key=wrong)
    assert out.returncode == 1
    no_secret(out)
    # Stripe's message quotes the key it was given: the command hides it.
    assert wrong not in out.stdout + out.stderr
    assert out.stderr.splitlines()[-1] == (
        "error: Stripe answered 401 to GET /v1/events: Invalid API Key provided: ***: "
        "STRIPE_API_KEY was not accepted (expired, revoked or mistyped)"
    )
    assert db.zcard(RUNS) == 0


def test_without_a_stripe_trigger_there_is_nothing_to_recover(
    stripe: StripeApi, recover: Recover, tmp_path: Path
) -> None:
    config = tmp_path / "triggers.yaml"
    config.write_text(CONFIG.replace("scheme: stripe", "scheme: token, header: X-Token"))
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "recover", "stripe", "--api-url", stripe.url,
         "--config", str(config), "--redis-url", recover.redis_url],
        env={**os.environ, "STRIPE_API_KEY": KEY}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (out.returncode, out.stderr) == (
        2,
        "Error: --path: no trigger uses verify scheme 'stripe'; nothing to recover\n",
    )
    assert stripe.calls == []
