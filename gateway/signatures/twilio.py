"""The string Twilio signs (Twilio, "Webhooks security"): the full URL it requested,
then, for an ``application/x-www-form-urlencoded`` POST, every form field's name and
value sorted by name; for any other body (JSON), the URL with a ``bodySHA256`` query
parameter (the hex SHA-256 of the raw body) appended, and nothing after it.

The request's URL does not reach ``verify`` (it sees headers and the body), so the
URL is the trigger's ``verify.url``: exactly the one configured in Twilio, query
string included. Pure code, shared by ``verify`` and ``sign`` so both build the
same bytes; it imports nothing of the gateway.
"""

from __future__ import annotations

import hashlib
from urllib.parse import parse_qsl, urlsplit

__all__ = ["FORM", "is_form", "signed_strings", "url_variants"]

FORM = "application/x-www-form-urlencoded"

# Twilio's own helper libraries accept a signature over the URL with its port
# removed or with the scheme's default port added, "since sig generation on back
# end is inconsistent" (twilio-python's RequestValidator): so does verify().
_DEFAULT_PORTS = {"https": 443, "http": 80}


def url_variants(url: str) -> tuple[str, ...]:
    """``url`` as configured, then as Twilio may also have signed it: without its
    port if it has one, else with the scheme's default port."""
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    if parts.port is not None:
        other = host[: host.rindex(":")]
    else:
        other = f"{host}:{_DEFAULT_PORTS.get(parts.scheme, 443)}"
    variant = parts._replace(netloc=other).geturl()
    return (url,) if variant == url else (url, variant)


def is_form(content_type: str) -> bool:
    """Whether a Content-Type value names a form body (parameters such as
    ``charset`` aside)."""
    return content_type.split(";", 1)[0].strip().lower() == FORM


def signed_strings(urls: tuple[str, ...], form: bool, body: bytes) -> list[bytes]:
    """What Twilio signed for each of ``urls``, for a form body or another one.

    Raises ValueError for a form body that is not UTF-8 form encoding.
    """
    if not form:
        digest = hashlib.sha256(body).hexdigest()
        return [f"{url}{'&' if '?' in url else '?'}bodySHA256={digest}".encode() for url in urls]
    # Strict decoding: Twilio sends UTF-8, and a body that is not cannot be the
    # one it signed (a lenient decode would map different bodies to one string).
    fields = parse_qsl(
        body.decode("utf-8"), keep_blank_values=True, encoding="utf-8", errors="strict"
    )
    values: dict[str, set[str]] = {}
    for name, value in fields:
        values.setdefault(name, set()).add(value)
    # As Twilio's helper libraries build it: names sorted (code point order, which
    # is Twilio's "case-sensitive" order), each name's distinct values sorted.
    tail = "".join(
        name + value for name in sorted(values) for value in sorted(values[name])
    ).encode("utf-8")
    return [url.encode("utf-8") + tail for url in urls]
