"""RequestHeaders: the webhook path's header look-ups (gateway/ingest/webhooks.py)."""

from __future__ import annotations

from gateway.ingest.webhooks import RequestHeaders

RAW = [(b"content-type", b"application/json"), (b"x-hub-signature-256", b"sha256=ab")]


def test_first_value_and_missing_names() -> None:
    headers = RequestHeaders(RAW)
    assert headers.get("content-type") == "application/json"
    assert headers.getlist("x-hub-signature-256") == ["sha256=ab"]
    assert headers.get("x-github-event") is None
    assert headers.getlist("x-github-event") == []


def test_a_repeated_name_keeps_every_value_in_order() -> None:
    headers = RequestHeaders([*RAW, (b"x-hub-signature-256", b"sha256=cd")])
    assert headers.getlist("x-hub-signature-256") == ["sha256=ab", "sha256=cd"]
    assert headers.get("x-hub-signature-256") == "sha256=ab"  # the first, as Starlette
    assert headers.get("content-type") == "application/json"


def test_values_round_trip_to_the_bytes_sent() -> None:
    # getlist is what verify reads: one character per byte. (Spaces and tabs at the
    # ends are not part of a value: they are trimmed.)
    sent = bytes(range(0x21, 0x7F)) + bytes(range(0xA0, 0x100))
    (value,) = RequestHeaders([(b"x-token", sent)]).getlist("x-token")
    assert value.encode("latin-1") == sent
