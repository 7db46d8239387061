"""Writes tests/payloads/vectors.json: signature vectors over the payloads in this folder.

Run ``python tests/payloads/make_vectors.py`` after changing a payload. It signs
with the standard library only (never with ``gateway``), so the tests that read
the file check the gateway against an independent implementation of each
sender's scheme. ``official`` vectors are values published by the sender
(their source is named in each); the rest are derived here.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GITHUB_SECRET = "It's a Secret to Everybody"
STRIPE_SECRET = "whsec_test_secret"
STANDARD_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
T0 = 1_735_689_600  # 2025-01-01T00:00:00Z


def github(secret: str, body: bytes) -> dict[str, str]:
    return {
        "X-Hub-Signature-256": "sha256="
        + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest(),
        "X-Hub-Signature": "sha1=" + hmac.new(secret.encode(), body, hashlib.sha1).hexdigest(),
    }


def stripe_v1(secret: str, t: int, body: bytes) -> str:
    # Stripe keys the HMAC with the whole secret string, whsec_ included.
    return hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()


def standard(secret: str, msg_id: str, t: int, body: bytes) -> str:
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{t}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def body_of(name: str) -> bytes:
    return (HERE / name).read_bytes()


def github_vector(vid: str, name: str, event: str, n: int) -> dict[str, Any]:
    body = body_of(name)
    return {
        "id": vid,
        "scheme": "github",
        "kind": "derived",
        "secret": GITHUB_SECRET,
        "body_file": name,
        "content_type": "application/json",
        "headers": {
            "X-GitHub-Event": event,
            "X-GitHub-Delivery": f"5d0c7b1e-8a2f-4c3d-9e6b-00000000000{n}",
            **github(GITHUB_SECRET, body),
            "Content-Type": "application/json",
        },
        "expected_valid": True,
    }


def stripe_vector(vid: str, name: str, t: int, **extra: Any) -> dict[str, Any]:
    sig = stripe_v1(STRIPE_SECRET, t, body_of(name))
    return {
        "id": vid,
        "scheme": "stripe",
        "kind": "derived",
        "secret": STRIPE_SECRET,
        "timestamp": t,
        "body_file": name,
        "content_type": "application/json; charset=utf-8",
        "headers": {"Stripe-Signature": f"t={t},v1={sig}"},
        "expected_valid": True,
        **extra,
    }


def vectors() -> list[dict[str, Any]]:
    hello = body_of("vectors/github.hello-world.txt")
    invoice = "stripe/invoice.paid.json"
    intent = "stripe/payment_intent.succeeded.json"
    std_id = "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W"
    return [
        {
            "id": "github-official-hello-world",
            "scheme": "github",
            "kind": "official",
            "source": "docs.github.com, 'Validating webhook deliveries', "
            "section 'Testing the webhook payload validation' (sha256 value; sha1 derived here)",
            "secret": GITHUB_SECRET,
            "body_file": "vectors/github.hello-world.txt",
            "content_type": None,
            "headers": {
                "X-Hub-Signature-256": "sha256="
                "757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17",
                "X-Hub-Signature": github(GITHUB_SECRET, hello)["X-Hub-Signature"],
            },
            "expected_valid": True,
        },
        github_vector("github-push-json", "github/push.json", "push", 1),
        github_vector(
            "github-pull_request-json", "github/pull_request.opened.json", "pull_request", 2
        ),
        {
            "id": "github-negative-tampered",
            "scheme": "github",
            "kind": "derived-negative",
            "secret": GITHUB_SECRET,
            "body_file": "vectors/github.hello-world.txt",
            "headers": {
                "X-Hub-Signature-256": github(GITHUB_SECRET, b"Hello, World?")[
                    "X-Hub-Signature-256"
                ]
            },
            "expected_valid": False,
            "note": "the signature of another body ('Hello, World?')",
        },
        {
            "id": "github-negative-sha1-only",
            "scheme": "github",
            "kind": "derived-negative",
            "secret": GITHUB_SECRET,
            "body_file": "vectors/github.hello-world.txt",
            "headers": {"X-Hub-Signature": github(GITHUB_SECRET, hello)["X-Hub-Signature"]},
            "expected_valid": False,
            "note": "a valid legacy SHA-1 header alone: X-Hub-Signature-256 is required",
        },
        stripe_vector("stripe-invoice.paid", invoice, T0),
        stripe_vector("stripe-payment_intent.succeeded", intent, T0),
        stripe_vector(
            "stripe-retry-same-event-new-timestamp",
            intent,
            T0 + 300,
            note="Stripe's retry: same body and evt_ id, a later t, so another v1",
        ),
        {
            "id": "stripe-negative-v0-only",
            "scheme": "stripe",
            "kind": "derived-negative",
            "secret": STRIPE_SECRET,
            "timestamp": T0,
            "body_file": intent,
            "headers": {
                "Stripe-Signature": f"t={T0},v0={stripe_v1(STRIPE_SECRET, T0, body_of(intent))}"
            },
            "expected_valid": False,
            "note": "the right HMAC under scheme v0, which must be ignored",
        },
        {
            "id": "stripe-negative-stale",
            "scheme": "stripe",
            "kind": "derived-negative",
            "secret": STRIPE_SECRET,
            "timestamp": T0,
            "verify_at": T0 + 301,
            "body_file": intent,
            "headers": {
                "Stripe-Signature": f"t={T0},v1={stripe_v1(STRIPE_SECRET, T0, body_of(intent))}"
            },
            "expected_valid": False,
            "note": "a right signature checked 301 s later (tolerance 300 s)",
        },
        {
            "id": "standard-webhooks-official-1",
            "scheme": "standard-webhooks",
            "kind": "official",
            "source": "standard-webhooks/standard-webhooks, "
            "libraries/python/tests/test_webhooks.py::test_sign_function",
            "secret": STANDARD_SECRET,
            "timestamp": 1614265330,
            "body_file": "vectors/standard-webhooks.test-2432232314.json",
            "headers": {
                "webhook-id": "msg_p5jXN8AQM9LWM0D4loKWxJek",
                "webhook-timestamp": "1614265330",
                "webhook-signature": "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
            },
            "expected_valid": True,
        },
        {
            "id": "standard-webhooks-official-2",
            "scheme": "standard-webhooks",
            "kind": "official",
            "source": "standard-webhooks/standard-webhooks, libraries/rust/src/lib.rs::test_sign",
            "secret": "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD",
            "timestamp": 1649367553,
            "body_file": "vectors/standard-webhooks.test-user.json",
            "headers": {
                "webhook-id": "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk",
                "webhook-timestamp": "1649367553",
                "webhook-signature": "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw=",
            },
            "expected_valid": True,
        },
        *[
            {
                "id": vid,
                "scheme": "standard-webhooks",
                "kind": "derived",
                "secret": STANDARD_SECRET,
                "timestamp": t,
                "body_file": invoice,
                "headers": {
                    "webhook-id": std_id,
                    "webhook-timestamp": str(t),
                    "webhook-signature": standard(STANDARD_SECRET, std_id, t, body_of(invoice)),
                },
                "expected_valid": True,
            }
            for vid, t in [
                ("standard-webhooks-payload-body", T0),
                ("standard-webhooks-retry-new-timestamp", T0 + 300),
            ]
        ],
        {
            "id": "standard-webhooks-negative-id-mismatch",
            "scheme": "standard-webhooks",
            "kind": "derived-negative",
            "secret": STANDARD_SECRET,
            "timestamp": T0,
            "body_file": invoice,
            "headers": {
                "webhook-id": std_id + "x",
                "webhook-timestamp": str(T0),
                "webhook-signature": standard(STANDARD_SECRET, std_id, T0, body_of(invoice)),
            },
            "expected_valid": False,
            "note": "webhook-id is signed: another id fails",
        },
        {
            "id": "gitlab-token-equality",
            "scheme": "gitlab",
            "kind": "derived",
            "secret": "my-gitlab-secret-token",
            "body_file": "vectors/github.hello-world.txt",
            "headers": {
                "X-Gitlab-Token": "my-gitlab-secret-token",
                "X-Gitlab-Event": "Push Hook",
                "Idempotency-Key": "0f6e2c1a-3b5d-4e7f-9a1c-2d4e6f8a0b1c",
            },
            "expected_valid": True,
            "note": "GitLab sends the configured token verbatim; no body signature",
        },
    ]


def main() -> None:
    doc = {
        "description": "Signature vectors over the payloads of tests/payloads/, written by "
        "make_vectors.py (standard library only). body_file is relative to tests/payloads/.",
        "vectors": vectors(),
    }
    (HERE / "vectors.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
