"""`realm send` as a user runs it: the real CLI in a process of its own, posting to a
real `realm listen` on a private Redis. Every signature scheme the gateway knows is
sent through (a scheme added later fails here until SCHEME_TRIGGERS knows it)."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import redis as redis_sync
import yaml

from gateway.signatures.schemes import SCHEMES
from tests.listener import Listener
from tests.servers import RedisServer, free_port

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
STRIPE_ID = re.compile(r"evt_[A-Za-z0-9]{24}")
BODY = {"id": "evt_in_the_file", "event_id": "ev-in-the-file", "text": "hello"}


class Case(NamedTuple):
    """How a minimal trigger of one scheme is written: its verify block (without
    secret_env), the secret its variable holds (None: the scheme takes none), where its
    event id is read, as the scheme's senders send it; ``signs``: False for a scheme
    whose trigger holds only the sender's public key, which realm send must refuse."""

    verify: dict[str, Any]
    secret: str | None
    event_id: dict[str, str]
    signs: bool = True


def discord_public_key() -> str:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    public = Ed25519PrivateKey.generate().public_key()
    return public.public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


IDEMPOTENCY_KEY = {"header": "Idempotency-Key"}
URL = "https://hooks.example.com/hooks/"

# Every scheme of gateway.signatures.schemes.SCHEMES, by name. A scheme missing here
# fails the tests that need it, with what to add.
SCHEME_TRIGGERS: dict[str, Case] = {
    "github": Case({"scheme": "github"}, "send-github-secret", {"header": "X-GitHub-Delivery"}),
    "stripe": Case({"scheme": "stripe"}, "whsec_send-stripe-secret", {"jsonpath": "$.id"}),
    "standard": Case(
        {"scheme": "standard"},
        "whsec_" + base64.b64encode(b"send-standard-secret-key").decode(),
        {"header": "webhook-id"},
    ),
    "hmac": Case(
        {
            "scheme": "hmac",
            "header": "X-Acme-Signature",
            "prefix": "v1=",
            "timestamp_header": "X-Acme-Timestamp",
        },
        "send-hmac-secret",
        {"jsonpath": "$.id"},
    ),
    "token": Case(
        {"scheme": "token", "header": "X-Realm-Token"}, "send-token-secret", IDEMPOTENCY_KEY
    ),
    "none": Case({"scheme": "none"}, None, IDEMPOTENCY_KEY),
    "slack": Case({"scheme": "slack"}, "send-slack-secret", {"jsonpath": "$.event_id"}),
    "shopify": Case(
        {"scheme": "shopify"}, "send-shopify-secret", {"header": "X-Shopify-Webhook-Id"}
    ),
    "gitlab": Case({"scheme": "gitlab"}, "send-gitlab-secret", IDEMPOTENCY_KEY),
    "zoom": Case({"scheme": "zoom"}, "send-zoom-secret", IDEMPOTENCY_KEY),
    "meta": Case({"scheme": "meta"}, "send-meta-secret", IDEMPOTENCY_KEY),
    "paddle": Case({"scheme": "paddle"}, "send-paddle-secret", {"jsonpath": "$.event_id"}),
    "linear": Case({"scheme": "linear"}, "send-linear-secret", {"jsonpath": "$.webhookId"}),
    "square": Case(
        {"scheme": "square", "url": URL + "square"},
        "send-square-secret",
        {"jsonpath": "$.event_id"},
    ),
    "twilio": Case(
        {"scheme": "twilio", "url": URL + "twilio"},
        "send-twilio-secret",
        {"header": "I-Twilio-Idempotency-Token"},
    ),
    "twitter": Case({"scheme": "twitter"}, "send-twitter-secret", IDEMPOTENCY_KEY),
    # The sender's private key is Discord's (AWS's for sns): nothing here can sign.
    "discord": Case({"scheme": "discord"}, discord_public_key(), {"jsonpath": "$.id"}, False),
    "sns": Case(
        {"scheme": "sns", "topic_arn": "arn:aws:sns:us-east-1:123456789012:orders"},
        None,
        {"jsonpath": "$.MessageId"},
        False,
    ),
}


def secret_variable(scheme: str) -> str:
    return f"SEND_{scheme.upper()}_SECRET"


def case(scheme: str) -> Case:
    if scheme not in SCHEME_TRIGGERS:
        pytest.fail(
            f"add scheme {scheme} to the table SCHEME_TRIGGERS in tests/test_send.py: its "
            "verify fields, a secret and where its sender puts the event id"
        )
    return SCHEME_TRIGGERS[scheme]


def scheme_trigger(scheme: str, **more: Any) -> dict[str, Any]:
    """The minimal trigger of ``scheme`` on /hooks/<scheme>, starting workflow ``w``."""
    verify, secret, event_id, _ = case(scheme)
    verify = {**verify, **({"secret_env": secret_variable(scheme)} if secret else {})}
    return {"workflow": "w", "path": f"/hooks/{scheme}", "verify": verify,
            "event_id": dict(event_id), **more}  # fmt: skip


SECRETS = {secret_variable(s): c.secret for s, c in SCHEME_TRIGGERS.items() if c.secret}
KNOWN = [s for s in SCHEMES if s in SCHEME_TRIGGERS]
CONFIG = yaml.safe_dump(
    {
        "version": 1,
        "workflows": {"w": {"steps": ["go"]}},
        "triggers": {
            **{f"{s}-hook": scheme_trigger(s) for s in KNOWN},
            # One path, two schemes: --trigger picks the one that signs.
            "mixed-github": {**scheme_trigger("github"), "path": "/hooks/mixed"},
            "mixed-token": {**scheme_trigger("token"), "path": "/hooks/mixed"},
            # A form body: its fields are read as JSONPath.
            "form-hook": {
                **scheme_trigger("token"),
                "path": "/hooks/form",
                "params": {"a": "$.a"},
            },
        },
    },
    sort_keys=False,
)


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServer
) -> Iterator[Listener]:
    listener = Listener(
        tmp_path_factory.mktemp("send"), CONFIG, redis_url=module_redis.url, env=SECRETS
    ).start()
    yield listener
    listener.stop()
    assert "Traceback" not in listener.log(), listener.log()[-3000:]


@pytest.fixture
def body(tmp_path: Path) -> Path:
    path = tmp_path / "event.json"
    path.write_text(json.dumps(BODY, indent=2))
    return path


def realm(
    gateway: Listener, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``realm ARGS`` in the listener's folder, with exactly the secrets of ``env``; no
    secret value in what it prints."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("REALM_", "SEND_"))}
    full.update(SECRETS if env is None else env)
    out = subprocess.run(
        [sys.executable, "-m", "gateway", *args, "--config", str(gateway.config_path)],
        cwd=gateway.workdir, env=full, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    for secret in SECRETS.values():
        assert secret not in out.stdout + out.stderr, "a secret was printed"
    assert "Traceback" not in out.stderr, out.stderr
    return out


def send(gateway: Listener, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return realm(gateway, "send", "--url", gateway.base_url, *args, **kwargs)


def sent(gateway: Listener, *args: str) -> dict[str, Any]:
    """``realm send ARGS --json``, which must exit 0: its JSON object."""
    out = send(gateway, *args, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


def result(reply: dict[str, Any], status: int, outcome: str) -> dict[str, Any]:
    """The reply's one trigger result, checked to be ``status`` and ``outcome``."""
    assert reply["status"] == status, reply
    (only,) = reply["body"]["results"]
    assert only["outcome"] == outcome, only
    return only


def run_key(gateway: Listener, run_id: str) -> str:
    out = realm(gateway, "run", "show", run_id, "--json", "--redis-url", str(gateway.redis_url))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["idempotency_key"]


# --------------------------------------------------------------------------- every scheme


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_scheme_starts_a_run(
    gateway: Listener, db: redis_sync.Redis, body: Path, scheme: str
) -> None:
    if not case(scheme).signs:  # a scheme the table does not know fails here, loudly
        cannot_sign(gateway, scheme, body)
        return
    out = sent(gateway, "--path", f"/hooks/{scheme}", "--body", str(body))
    assert out["triggers"] == [f"{scheme}-hook"]
    (reply,) = out["replies"]
    result(reply, 202, "started")
    assert out["ok"] is True


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_scheme_repeats_as_a_redelivery(
    gateway: Listener, db: redis_sync.Redis, body: Path, scheme: str
) -> None:
    if not case(scheme).signs:
        cannot_sign(gateway, scheme, body, "--repeat", "3")
        return
    out = sent(gateway, "--path", f"/hooks/{scheme}", "--body", str(body), "--repeat", "3")
    first, *again = out["replies"]
    run_id = result(first, 202, "started")["run_id"]
    assert len(again) == 2
    assert [result(r, 200, "deduplicated")["run_id"] for r in again] == [run_id, run_id]


def cannot_sign(gateway: Listener, scheme: str, body: Path, *args: str) -> None:
    """A trigger holding only its sender's public key: refused in one line, nothing sent."""
    out = send(gateway, "--path", f"/hooks/{scheme}", "--body", str(body), *args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr == (
        f"error: realm send cannot sign as the sender of trigger {scheme}-hook (scheme "
        f"{scheme}): the gateway holds no key that signs for it\n"
    )
    assert out.stdout == ""


# --------------------------------------------------------------------------- event ids


def test_event_id_goes_in_the_header_the_trigger_reads(
    gateway: Listener, db: redis_sync.Redis, body: Path
) -> None:
    out = send(gateway, "--path", "/hooks/github", "--body", str(body), "--event-id", "d-42")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:2] == [f"POST {gateway.base_url}/hooks/github (event id d-42)", "202 Accepted"]
    reply = {"status": 202, "body": json.loads("\n".join(lines[2:]))}
    assert run_key(gateway, result(reply, 202, "started")["run_id"]) == "d-42"
    # Without --event-id, each send is a new event with a fresh UUID (a token trigger:
    # no replay guard folds the same body under a new id onto the first run).
    first, second = (sent(gateway, "--path", "/hooks/token", "--body", str(body)) for _ in "ab")
    assert first["event_id"] != second["event_id"]
    for out_ in (first, second):
        assert UUID.fullmatch(out_["event_id"])
        run_id = result(out_["replies"][0], 202, "started")["run_id"]
        assert run_key(gateway, run_id) == out_["event_id"]


def test_event_id_goes_in_the_body_where_the_trigger_reads_it(
    gateway: Listener, db: redis_sync.Redis, body: Path
) -> None:
    given = sent(gateway, "--path", "/hooks/stripe", "--body", str(body), "--event-id", "evt_42")
    assert run_key(gateway, result(given["replies"][0], 202, "started")["run_id"]) == "evt_42"
    fresh = sent(gateway, "--path", "/hooks/stripe", "--body", str(body))
    assert STRIPE_ID.fullmatch(fresh["event_id"]), fresh["event_id"]
    run_id = result(fresh["replies"][0], 202, "started")["run_id"]
    assert run_key(gateway, run_id) == fresh["event_id"]
    kept = sent(gateway, "--path", "/hooks/stripe", "--body", str(body), "--keep-id")
    assert kept["event_id"] == BODY["id"]
    assert run_key(gateway, result(kept["replies"][0], 202, "started")["run_id"]) == BODY["id"]
    assert json.loads(body.read_text()) == BODY  # the file itself is left alone


def test_keep_id_needs_an_id_in_the_body(gateway: Listener, body: Path) -> None:
    out = send(gateway, "--path", "/hooks/github", "--body", str(body), "--keep-id")
    assert out.returncode == 2
    assert out.stderr.startswith("error: --keep-id keeps the event id the body holds"), out.stderr
    assert len(out.stderr.splitlines()) == 1


# --------------------------------------------------------------------------- triggers, bodies


def test_a_path_whose_triggers_verify_differently_needs_trigger(
    gateway: Listener, db: redis_sync.Redis, body: Path
) -> None:
    out = send(gateway, "--path", "/hooks/mixed", "--body", str(body))
    assert out.returncode == 2
    assert out.stderr == (
        "error: the triggers of /hooks/mixed verify differently: mixed-github (github), "
        "mixed-token (token X-Realm-Token); pick the one to sign as with --trigger NAME\n"
    )
    picked = sent(
        gateway, "--path", "/hooks/mixed", "--body", str(body), "--trigger", "mixed-token"
    )
    assert picked["triggers"] == ["mixed-token"]
    results = {r["trigger"]: r["outcome"] for r in picked["replies"][0]["body"]["results"]}
    assert picked["replies"][0]["status"] == 202
    assert results["mixed-token"] == "started"


def test_a_form_encoded_file_is_sent_as_a_form(
    gateway: Listener, db: redis_sync.Redis, tmp_path: Path
) -> None:
    form = tmp_path / "event.form"
    form.write_text("a=1&b=two")
    out = sent(gateway, "--path", "/hooks/form", "--body", str(form))
    run_id = result(out["replies"][0], 202, "started")["run_id"]
    shown = realm(gateway, "run", "show", run_id, "--json", "--redis-url", str(gateway.redis_url))
    assert json.loads(shown.stdout)["params"] == {"a": "1"}


# --------------------------------------------------------------------------- errors


def test_an_unknown_path_names_the_known_ones(gateway: Listener, body: Path) -> None:
    out = send(gateway, "--path", "/hooks/nope", "--body", str(body))
    assert out.returncode == 2
    assert out.stderr.startswith("error: no trigger has path /hooks/nope (paths: /hooks/"), (
        out.stderr
    )
    assert "/hooks/github" in out.stderr and len(out.stderr.splitlines()) == 1


def test_a_missing_secret_names_its_variable_and_no_value(gateway: Listener, body: Path) -> None:
    env = {k: v for k, v in SECRETS.items() if k != secret_variable("github")}
    out = send(gateway, "--path", "/hooks/github", "--body", str(body), env=env)
    assert out.returncode == 3
    assert out.stderr == (
        f"error: environment variable {secret_variable('github')} is not set: trigger "
        "github-hook signs with the secret it holds (verify.secret_env)\n"
    )
    assert out.stdout == ""  # and realm() checked that no other secret was printed


def test_a_reply_that_is_not_a_2xx_exits_1(gateway: Listener, body: Path) -> None:
    wrong = {**SECRETS, secret_variable("github"): "not-the-listener-s-secret"}
    out = send(gateway, "--path", "/hooks/github", "--body", str(body), env=wrong)
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.splitlines()[1] == "401 Unauthorized"
    assert "not-the-listener-s-secret" not in out.stdout + out.stderr


def test_a_listener_that_does_not_answer_is_one_line(gateway: Listener, body: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    out = realm(gateway, "send", "--url", url, "--path", "/hooks/github", "--body", str(body))
    assert out.returncode == 4
    assert out.stderr == f"error: the listener at {url} is not answering (connection refused)\n"
    assert out.stdout == ""
