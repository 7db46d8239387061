"""The frame every ``/ui`` page shares, and the pages that are nothing but a frame:
login, errors."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.faces.ui.markup import Html, esc, fill

# Notices a redirect may ask a page to show (?notice=...): fixed texts, so a link
# cannot make the page say anything else.
NOTICES = {
    "replayed": "Replayed: this is the new delivery the replay recorded.",
    "cancelled": "The run is cancelled.",
    "not-cancelled": "The run had already ended: nothing was cancelled.",
    "logged-out": "You are logged out.",
}


@dataclass(frozen=True)
class Frame:
    """What the frame shows around a page: the logout form (with the session's CSRF
    value), the configuration version, a notice or an error."""

    csrf: str | None = None
    version: str | None = None
    notice: str | None = None
    error: str | None = None


def page(title: str, body: Html, frame: Frame = Frame()) -> Html:
    nav = Html("")
    if frame.csrf is not None:
        nav = fill(
            '<nav><a href="/ui">Deliveries</a><a href="/ui/runs">Runs</a>'
            '<form method="post" action="/ui/logout" class="inline">'
            '<input type="hidden" name="csrf" value="{csrf}">'
            '<button type="submit" class="link">Log out</button></form></nav>',
            csrf=frame.csrf,
        )
    messages = Html("")
    if frame.notice:
        messages = fill('<p class="notice" role="status">{text}</p>', text=frame.notice)
    if frame.error:
        messages += fill('<p class="error" role="alert">{text}</p>', text=frame.error)
    footer = Html("")
    if frame.version:
        footer = fill("<footer>Configuration version {version}</footer>", version=frame.version)
    return fill(
        """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="referrer" content="no-referrer">
<title>{title} · Realm Gateway</title>
<link rel="stylesheet" href="/ui/static/ui.css">
<link rel="icon" href="/ui/static/icon.svg" type="image/svg+xml">
</head>
<body>
<header><a class="brand" href="/ui">Realm Gateway</a>{nav}</header>
<main>
{messages}<h1>{title}</h1>
{body}
</main>
{footer}
</body>
</html>
""",
        title=title,
        nav=nav,
        messages=messages,
        body=body,
        footer=footer,
    )


def login_page(next_path: str, frame: Frame = Frame()) -> Html:
    body = fill(
        """<form method="post" action="/ui/login" class="login">
<input type="hidden" name="next" value="{next}">
<label for="token">API token</label>
<input id="token" name="token" type="password" autocomplete="current-password" required autofocus>
<p class="hint">The gateway's REALM_API_TOKEN, the one <code>/v1</code> takes.</p>
<button type="submit">Log in</button>
</form>""",
        next=next_path,
    )
    return page("Log in", body, frame)


def message_page(title: str, text: str, frame: Frame = Frame(), back: str | None = None) -> Html:
    """A page that only says something: an error, the inspector being off."""
    body = fill('<p class="error" role="alert">{text}</p>', text=text)
    if back:
        body += fill('<p><a href="{href}">Back</a></p>', href=back)
    return page(title, body, frame)


def badge(text: str, kind: str | None = None) -> Html:
    """A word in a coloured box: an outcome, a phase, a status class."""
    return fill('<span class="badge {kind}">{text}</span>', kind=kind or text, text=text)


def status_badge(status: int) -> Html:
    return badge(str(status), f"s{status // 100}xx")


def run_link(run_id: str | None) -> Html:
    if not run_id:
        return Html("")
    return fill('<a class="id" href="/ui/runs/{id}">{id}</a>', id=run_id)


def delivery_link(delivery_id: str | None) -> Html:
    if not delivery_id:
        return Html("")
    return fill('<a class="id" href="/ui/deliveries/{id}">{id}</a>', id=delivery_id)


def rows(pairs: list[tuple[str, object]]) -> Html:
    """A two-column table of labelled facts (empty values left out)."""
    cells = [
        fill("<tr><th>{label}</th><td>{value}</td></tr>", label=label, value=value)
        for label, value in pairs
        if value not in (None, "")
    ]
    return fill('<table class="facts">{rows}</table>', rows=Html("".join(cells)))


def options(values: list[str], chosen: str | None, blank: str) -> Html:
    """``<option>``s for a filter: the blank one first (no filter)."""
    out = [fill('<option value="">{blank}</option>', blank=blank)]
    for value in values:
        selected = Html(" selected") if value == chosen else Html("")
        out.append(fill('<option value="{v}"{s}>{v}</option>', v=value, s=selected))
    return Html("".join(out))


def esc_or_dash(value: object) -> Html:
    return esc(value) if value not in (None, "") else Html("—")
