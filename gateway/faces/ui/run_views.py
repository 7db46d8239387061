"""The runs' pages: runs by workflow and phase, and one run with its steps, the
current step's attempts, its output and the chain of runs it reran."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from gateway.faces.ui.layout import Frame, badge, esc_or_dash, options, page, rows, run_link
from gateway.faces.ui.markup import Html, fill, join, pretty_value, when
from gateway.store.runs import PHASES, WAITING, Run

# How far back the lineage follows rerun_of: far enough for any real history, and a
# bound on the reads one page makes.
MAX_LINEAGE = 20


@dataclass(frozen=True)
class StepState:
    """What the run hash holds of its current step besides the Run fields: the attempt
    count (the store keeps it for the current step only), the lease and its deadline
    (or, with no lease, when a failed attempt's retry is due), and the last output."""

    attempt: int = 0
    lease: str | None = None
    lease_until_ms: int | None = None
    output: Any = None


@dataclass(frozen=True)
class Ancestor:
    """One run of the lineage; ``run`` None when it is no longer in the store."""

    run_id: str
    run: Run | None


def runs_page(
    runs: Sequence[Run],
    filters: Mapping[str, str],
    workflows: list[str],
    next_cursor: str | None,
    frame: Frame,
) -> Html:
    form = fill(
        """<form method="get" action="/ui/runs" class="filters">
<label>Workflow <select name="workflow">{workflows}</select></label>
<label>Phase <select name="phase">{phases}</select></label>
<label>Key <input name="key" value="{key}" placeholder="idempotency key"></label>
<button type="submit">Filter</button> <a href="/ui/runs">Clear</a>
</form>""",
        workflows=options(workflows, filters.get("workflow"), "all"),
        phases=options(list(PHASES), filters.get("phase"), "any"),
        key=filters.get("key", ""),
    )
    if not runs:
        table = Html('<p class="empty">No run matches.</p>')
    else:
        table = fill(
            """<table class="list" id="runs"><thead><tr><th>Created</th><th>Workflow</th>
<th>Phase</th><th>Step</th><th>Key</th><th>Run</th><th>Rerun of</th></tr></thead>
<tbody>{rows}</tbody></table>""",
            rows=join(_run_row(run) for run in runs),
        )
    more = Html("")
    if next_cursor:
        query = urlencode({**{k: v for k, v in filters.items() if v}, "cursor": next_cursor})
        more = fill('<p class="more"><a href="/ui/runs?{q}" rel="next">Older runs</a></p>', q=query)
    return page("Runs", form + table + more, frame)


def _run_row(run: Run) -> Html:
    return fill(
        '<tr class="run"><td data-label="Created">{created}</td>'
        '<td data-label="Workflow">{workflow}</td><td data-label="Phase">{phase}</td>'
        '<td data-label="Step">{step}</td><td data-label="Key"><code>{key}</code></td>'
        '<td data-label="Run">{link}</td><td data-label="Rerun of">{old}</td></tr>',
        created=when(run.created_ms),
        workflow=run.workflow,
        phase=badge(run.phase),
        step=run.step if run.phase == "running" else "",
        key=run.key,
        link=run_link(run.id),
        old=run_link(run.rerun_of),
    )


def run_page(
    run: Run, state: StepState, lineage: Sequence[Ancestor], now_ms: int, frame: Frame
) -> Html:
    key = Html("")
    if run.key:
        query = urlencode({"workflow": run.workflow, "key": run.key})
        key = fill(
            '<code>{key}</code> (<a href="/ui/runs?{q}">all its runs</a>)', key=run.key, q=query
        )
    facts = rows(
        [
            ("Id", fill('<code class="id">{id}</code>', id=run.id)),
            ("Workflow", run.workflow),
            ("Idempotency key", key),
            ("Phase", fill('<span id="phase">{b}</span>', b=badge(run.phase))),
            ("Next step", run.next_step),
            ("Created", when(run.created_ms)),
            ("Updated", when(run.updated_ms)),
            ("Ended", when(run.ended_ms)),
            ("Due", when(run.due_ms)),
            ("Rerun of", run_link(run.rerun_of)),
            (
                "Error",
                fill('<span class="error-text">{e}</span>', e=run.error) if run.error else "",
            ),
        ]
    )
    body = facts + _cancel_form(run, frame.csrf)
    body += _steps_table(run, state, now_ms)
    body += fill('<h2>Params</h2><pre id="params">{p}</pre>', p=pretty_value(run.params))
    if state.output is not None:
        body += fill(
            '<h2>Output</h2><p class="hint">Of the last step that completed; the next '
            'step is handed it.</p><pre id="output">{o}</pre>',
            o=pretty_value(state.output),
        )
    body += _lineage(run, lineage)
    return page(f"Run {run.id}", body, frame)


def _cancel_form(run: Run, csrf: str | None) -> Html:
    if run.phase not in ("running", *WAITING):
        return Html("")
    return fill(
        """<form method="post" action="/ui/runs/{id}/cancel" class="cancel">
<input type="hidden" name="csrf" value="{csrf}">
<button type="submit" class="danger">Cancel this run</button>
</form>""",
        id=run.id,
        csrf=csrf or "",
    )


def step_states(run: Run, state: StepState, now_ms: int) -> list[tuple[str, str, str]]:
    """Each step with what it is now and its attempts (known for the current step only)."""
    current = run.steps.index(run.step) if run.step in run.steps else None
    out = []
    for i, name in enumerate(run.steps):
        attempts = ""
        if run.phase == "completed" or (current is not None and i < current):
            what = "done"
        elif current is None or i > current:
            what = "waiting" if run.phase == "running" else "not reached"
        else:
            attempts = str(state.attempt) if state.attempt else ""
            what = _current_step(run.phase, state, now_ms)
        out.append((name, what, attempts))
    return out


def _current_step(phase: str, state: StepState, now_ms: int) -> str:
    if phase != "running":
        return {
            "failed": "failed here",
            "cancelled": "cancelled here",
            "queued": "queued: starts when a live run of its key ends",
            "scheduled": "scheduled: starts when due",
        }.get(phase, phase)
    if not state.attempt:
        return "ready: waiting for a runner"
    until = state.lease_until_ms
    if state.lease and until is not None:
        if until > now_ms:
            return f"taken: attempt {state.attempt}, leased for {(until - now_ms) // 1000} s more"
        return f"attempt {state.attempt}'s lease lapsed: it will be taken again"
    if until is not None:
        return f"attempt {state.attempt} failed: retry in {max(until - now_ms, 0) // 1000} s"
    return f"attempt {state.attempt}"


def _steps_table(run: Run, state: StepState, now_ms: int) -> Html:
    cells = join(
        fill(
            '<tr class="step"><td data-label="#">{n}</td><td data-label="Step">{name}</td>'
            '<td data-label="State">{what}</td><td data-label="Attempts">{attempts}</td></tr>',
            n=i + 1,
            name=name,
            what=what,
            attempts=esc_or_dash(attempts),
        )
        for i, (name, what, attempts) in enumerate(step_states(run, state, now_ms))
    )
    return fill(
        """<h2>Steps</h2>
<table class="list" id="steps"><thead><tr><th>#</th><th>Step</th><th>State</th>
<th>Attempts</th></tr></thead><tbody>{cells}</tbody></table>
<p class="hint">The store counts the attempts of the current step only; the error is the
last one reported.</p>""",
        cells=cells,
    )


def _lineage(run: Run, lineage: Sequence[Ancestor]) -> Html:
    if not run.rerun_of:
        return Html("")
    items = [
        fill("<li>{link} {phase} (this run)</li>", link=run_link(run.id), phase=badge(run.phase))
    ]
    for ancestor in lineage:
        if ancestor.run is None:
            items.append(
                fill(
                    '<li><code class="id">{id}</code> <span class="hint">no longer in the '
                    "store (past its workflow's retention)</span></li>",
                    id=ancestor.run_id,
                )
            )
        else:
            items.append(
                fill(
                    "<li>{link} {phase} created {created}</li>",
                    link=run_link(ancestor.run_id),
                    phase=badge(ancestor.run.phase),
                    created=when(ancestor.run.created_ms),
                )
            )
    last = lineage[-1] if lineage else None
    if len(lineage) >= MAX_LINEAGE and last is not None and last.run and last.run.rerun_of:
        items.append(fill('<li class="hint">… older runs not shown</li>'))
    return fill(
        '<h2>Lineage</h2><p class="hint">Each run reran the one below it (rerun_of).</p>'
        '<ol class="lineage" id="lineage">{items}</ol>',
        items=join(items),
    )
