"""The delivery log's pages: the filtered list, and one delivery with its headers,
body and each trigger's decision (records as gateway/deliveries/log.py builds them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlencode

from gateway.deliveries.log import OUTCOMES
from gateway.faces.ui.layout import (
    Frame,
    badge,
    delivery_link,
    esc_or_dash,
    options,
    page,
    rows,
    run_link,
    status_badge,
)
from gateway.faces.ui.markup import Html, fill, join, pretty_json, pretty_value, when

# What the status filter offers; any status or class (``418``, ``3xx``) may be typed.
STATUS_CHOICES = ["2xx", "202", "200", "4xx", "401", "422", "5xx", "503"]


def deliveries_page(
    items: Sequence[Mapping[str, Any]],
    filters: Mapping[str, str],
    paths: list[str],
    next_cursor: str | None,
    frame: Frame,
    spooled: tuple[int, float] | None = None,
) -> Html:
    """``spooled``: this worker's spool holds that many deliveries, the oldest that many
    seconds old, which Redis has not taken yet."""
    form = fill(
        """<form method="get" action="/ui" class="filters">
<label>Path <input name="path" list="paths" value="{path}" placeholder="/hooks/…"></label>
<datalist id="paths">{paths}</datalist>
<label>Status <input name="status" list="statuses" value="{status}" placeholder="202, 4xx"
 size="8"></label>
<datalist id="statuses">{statuses}</datalist>
<label>Outcome <select name="outcome">{outcomes}</select></label>
<button type="submit">Filter</button> <a href="/ui">Clear</a>
</form>""",
        path=filters.get("path", ""),
        paths=join(fill('<option value="{p}">', p=p) for p in paths),
        status=filters.get("status", ""),
        statuses=join(fill('<option value="{s}">', s=s) for s in STATUS_CHOICES),
        outcomes=options(list(OUTCOMES), filters.get("outcome"), "any"),
    )
    if not items and next_cursor:
        # A filtered page examines a bounded stretch of the log (gateway/deliveries/log.py).
        table = Html('<p class="empty">None of the deliveries examined so far matches.</p>')
    elif not items:
        table = Html('<p class="empty">No delivery matches.</p>')
    else:
        table = fill(
            """<table class="list" id="deliveries">
<thead><tr><th>Received</th><th>Status</th><th>Path</th><th>Triggers</th><th>Delivery</th>
</tr></thead>
<tbody>{rows}</tbody></table>""",
            rows=join(_list_row(item) for item in items),
        )
    more = Html("")
    if next_cursor:
        query = urlencode({**{k: v for k, v in filters.items() if v}, "cursor": next_cursor})
        more = fill(
            '<p class="more"><a href="/ui?{q}" rel="next">Older deliveries</a></p>', q=query
        )
    note = Html("")
    if spooled is not None and spooled[0]:
        note = fill(
            '<p class="spool" id="spool">This worker\'s spool holds {n} the store has not taken '
            "yet (the oldest {age} s old). They are listed as <em>accepted</em> once the "
            "log can be written, and get their outcome as the spool drains.</p>",
            n=f"{spooled[0]} deliver{'y' if spooled[0] == 1 else 'ies'}",
            age=f"{spooled[1]:.0f}",
        )
    return page("Deliveries", note + form + table + more, frame)


def _list_row(item: Mapping[str, Any]) -> Html:
    outcomes = [
        fill(
            "<li>{trigger} {outcome} {run}</li>",
            trigger=o["trigger"],
            outcome=badge(o["outcome"]),
            run=run_link(o.get("run_id")),
        )
        for o in item.get("outcomes") or []
    ]
    triggers = fill('<ul class="outcomes">{li}</ul>', li=join(outcomes)) if outcomes else Html("")
    if item.get("code"):
        triggers += fill('<span class="code">{code}</span>', code=item["code"])
    replay = Html("")
    if item.get("replay_of"):
        replay = Html(' <span class="badge replay">replay</span>')
    return fill(
        '<tr class="delivery"><td data-label="Received">{received}</td>'
        '<td data-label="Status">{status}</td><td data-label="Path"><code>{path}</code></td>'
        '<td data-label="Triggers">{triggers}</td>'
        '<td data-label="Delivery">{link}{replay}</td></tr>',
        received=when(item.get("received_ms")),
        status=status_badge(int(item["status"])),
        path=item["path"],
        triggers=triggers,
        link=delivery_link(item["delivery_id"]),
        replay=replay,
    )


def delivery_page(
    record: Mapping[str, Any],
    not_replayable: str | None,
    frame: Frame,
    phases: Mapping[str, str | None] | None = None,
) -> Html:
    """One delivery. ``not_replayable``: why it cannot be replayed (None: it can);
    ``phases``: the phase each run it names is in now (None: the run is gone)."""
    facts = rows(
        [
            ("Id", fill('<code class="id">{id}</code>', id=record["delivery_id"])),
            ("Received", when(record.get("received_ms"))),
            ("Path", fill("<code>{p}</code>", p=record["path"])),
            ("Status", status_badge(int(record["status"]))),
            ("Code", record.get("code")),
            ("Message", record.get("message")),
            ("Answered in", f"{record['ms']} ms" if record.get("ms") is not None else None),
            ("Configuration", record.get("config_version")),
            ("Replay of", delivery_link(record.get("replay_of"))),
            ("Replayed as", "rerun (new runs)" if record.get("rerun") else None),
        ]
    )
    triggers = record.get("triggers") or []
    body = facts + _triggers_table(triggers, bool(record.get("replay_of")), phases or {})
    body += _replay_form(record["delivery_id"], not_replayable, frame.csrf)
    body += _headers_table(record.get("headers"))
    body += _body_block(record)
    return page(f"Delivery {record['delivery_id']}", body, frame)


def _triggers_table(
    triggers: Sequence[Mapping[str, Any]], replay: bool, phases: Mapping[str, str | None]
) -> Html:
    """Each trigger of the path and each step's word on it: the signature, ``when``,
    what was extracted, the decision and why. (A record written before the log kept
    the steps has the decision only.)"""
    if not triggers:
        return Html(
            '<h2>Triggers</h2><p class="empty">No trigger decided anything: the delivery '
            "was refused before matching (its status and message say why).</p>"
        )
    rendered = [
        fill(
            '<tr class="trigger"><td data-label="Trigger">{name}<br>'
            '<span class="hint">→ {workflow}</span></td>'
            '<td data-label="Signature">{signature}</td><td data-label="When">{when}</td>'
            '<td data-label="Key">{key}</td><td data-label="Decision">{outcome}</td>'
            '<td data-label="Run">{run}</td><td data-label="Why" class="why">{why}</td></tr>',
            name=t["trigger"],
            workflow=t.get("workflow"),
            signature=_signature(t, replay),
            when=_when(t),
            key=_extracted(t),
            outcome=badge(t["outcome"]),
            run=_run(t, phases),
            why=_why(t),
        )
        for t in triggers
    ]
    return fill(
        """<h2>Triggers</h2>
<table class="list" id="triggers"><thead><tr><th>Trigger</th><th>Signature</th><th>When</th>
<th>Event id, key</th><th>Decision</th><th>Run</th><th>Why</th></tr></thead>
<tbody>{rows}</tbody></table>""",
        rows=join(rendered),
    )


def _signature(t: Mapping[str, Any], replay: bool) -> Html:
    if "signature" not in t:
        return Html("")
    if t["signature"] == "ok":
        return badge("verified", "ok")
    if t["signature"] is None:
        return Html('<span class="hint">not checked (a replay)</span>') if replay else Html("")
    return fill("{b} {why}", b=badge("failed", "refused"), why=t["signature"])


def _when(t: Mapping[str, Any]) -> Html:
    if t.get("matched") is True:
        return Html("held")
    if t.get("matched") is False:
        return fill("did not hold: {why}", why=t.get("why_not"))
    return Html('<span class="hint">not reached</span>') if "matched" in t else Html("")


def _extracted(t: Mapping[str, Any]) -> Html:
    parts = []
    if t.get("event_id") is not None:
        parts.append(fill("event id <code>{v}</code>", v=t["event_id"]))
    if t.get("key") is not None:
        parts.append(fill("key <code>{v}</code>", v=t["key"]))
    if t.get("params") is not None:
        parts.append(
            fill(
                "<details><summary>params</summary><pre>{p}</pre></details>",
                p=pretty_value(t["params"]),
            )
        )
    return join(parts, "<br>")


def _run(t: Mapping[str, Any], phases: Mapping[str, str | None]) -> Html:
    """The run a trigger was given, with its phase now; the phase the record holds is
    the one at delivery, shown (so labelled) when it differs or the run is gone."""
    run = run_link(t.get("run_id"))
    recorded = t.get("phase")
    if t.get("run_id") in phases:
        now = phases[t["run_id"]]
        run += fill(" {b}", b=badge(now)) if now else Html(' <span class="hint">(gone)</span>')
        if recorded and recorded != now:
            run += fill('<br><span class="hint">{phase} at delivery</span>', phase=recorded)
    elif recorded:
        run += fill(' <span class="hint">({phase} at delivery)</span>', phase=recorded)
    if t.get("rerun_of"):
        run += fill('<br><span class="hint">rerun of</span> {old}', old=run_link(t["rerun_of"]))
    return run


def _why(t: Mapping[str, Any]) -> Html:
    text = t.get("message")
    if text is None and t["outcome"] == "unverified":
        text = t.get("signature")
    why = esc_or_dash(text)
    if t.get("code"):
        why = fill('<span class="code">{code}</span> {why}', code=t["code"], why=why)
    if t.get("params_mismatch"):
        why += Html(' <span class="badge refused">params differ from the run\'s</span>')
    return why


def _replay_form(delivery_id: str, not_replayable: str | None, csrf: str | None) -> Html:
    if not_replayable is not None:
        return fill(
            '<h2>Replay</h2><p class="hint" id="not-replayable">Cannot be replayed: {why}</p>',
            why=not_replayable,
        )
    return fill(
        """<h2>Replay</h2>
<form method="post" action="/ui/deliveries/{id}/replay" class="replay">
<input type="hidden" name="csrf" value="{csrf}">
<label><input type="checkbox" name="rerun" value="1"> Rerun: each matched trigger starts a
new run (a live one is cancelled first)</label>
<button type="submit">Replay</button>
</form>
<p class="hint">Sent again through today's triggers of its path, without checking the
signature again (it was checked on arrival). Without rerun, the triggers' policies
decide, so a delivery that started a run is deduplicated to it.</p>""",
        id=delivery_id,
        csrf=csrf or "",
    )


def _headers_table(headers: Sequence[Sequence[str]] | None) -> Html:
    if headers is None:
        return Html(
            '<h2>Headers</h2><p class="empty">Not kept: the delivery was refused before '
            "its signature was verified.</p>"
        )
    cells = join(
        fill("<tr><th>{name}</th><td>{value}</td></tr>", name=name, value=value)
        for name, value in headers
    )
    return fill(
        '<h2>Headers</h2><p class="hint">Signatures, tokens and cookies are never kept.</p>'
        '<table class="facts headers" id="headers">{cells}</table>',
        cells=cells,
    )


def _body_block(record: Mapping[str, Any]) -> Html:
    text = record.get("body")
    size = record.get("body_size")
    if text is None:
        why = (
            "not kept: the delivery was refused before its signature was verified"
            if record.get("headers") is None
            else "not kept (settings.store_bodies is false)"
        )
        return fill('<h2>Body</h2><p class="empty">{why}.</p>', why=why)
    notes = [f"{size} bytes"] if size is not None else []
    shown = text
    if record.get("body_encoding") == "base64":
        notes.append("not UTF-8 text: shown in base64")
    else:
        pretty = pretty_json(text)
        if pretty is not None:
            shown = pretty
            notes.append("JSON, re-indented")
    if record.get("body_truncated"):
        notes.append("stored cut at settings.max_stored_body_bytes")
    return fill(
        '<h2>Body</h2><p class="hint">{notes}</p><pre id="body">{body}</pre>',
        notes=", ".join(notes),
        body=shown,
    )
