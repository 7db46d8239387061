"""The `realm run` commands as a user runs them: real processes, real servers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import WORKFLOWS_YAML
from tests.listener import Listener
from tests.servers import free_port

UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


def realm(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "REALM_REDIS_URL"}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "triggers.yaml").write_text(WORKFLOWS_YAML)
    return tmp_path


@pytest.fixture
def cli(workdir: Path, redis, redis_server):
    def run(*args: str) -> subprocess.CompletedProcess:
        return realm(*args, "--redis-url", redis_server.url, cwd=workdir)

    return run


def test_start_then_repeat_prints_the_documented_replies(cli):
    first = cli("run", "start", "sync", "--key", "order-4417")
    assert first.returncode == 0, first.stderr
    run_id = re.search(rf"run_id: ({UUID})", first.stdout).group(1)
    assert first.stdout == (
        "status: ok\n"
        "deduped: false\n"
        f"run_id: {run_id}\n"
        f"Run '{run_id}' created for workflow 'sync'. Ready for the agent: 'fetch'.\n"
    )
    assert "using Redis at redis://127.0.0.1:" in first.stderr

    again = cli("run", "start", "sync", "--key", "order-4417")
    assert again.stdout == (
        "status: ok\n"
        "deduped: true\n"
        f"run_id: {run_id}\n"
        f"Matched existing run '{run_id}' (idempotent) in phase 'running'; no new run created. "
        "Ready for the agent: 'fetch'.\n"
    )


def test_fail_policy_prints_status_error_and_exits_non_zero(cli):
    first = cli("run", "start", "sync", "--key", "k", "--json")
    run_id = json.loads(first.stdout)["run_id"]
    refused = cli("run", "start", "sync", "--key", "k", "--on-live-match", "fail")
    assert refused.returncode == 1
    assert refused.stdout == (
        "status: error\n"
        "STATE_RUN_ALREADY_ACTIVE: Idempotency key for workflow 'sync' is owned by an active "
        f"run '{run_id}' (phase 'running').\n"
    )
    as_json = cli("run", "start", "sync", "--key", "k", "--on-live-match", "fail", "--json")
    assert json.loads(as_json.stdout) == {
        "status": "error",
        "code": "STATE_RUN_ALREADY_ACTIVE",
        "message": f"Idempotency key for workflow 'sync' is owned by an active run '{run_id}' "
        "(phase 'running').",
    }


def test_rerun_after_completion_shows_lineage_in_reply_and_in_show(cli):
    first = json.loads(cli("run", "start", "sync", "--key", "k", "--json").stdout)["run_id"]
    for step in ("fetch", "transform", "load"):
        done = cli("run", "complete", first, "--step", step)
        assert done.returncode == 0, done.stdout + done.stderr
    assert "is completed" in done.stdout

    rerun = cli("run", "start", "sync", "--key", "k", "--on-terminal-match", "rerun")
    new = re.search(rf"run_id: ({UUID})", rerun.stdout).group(1)
    assert rerun.stdout == (
        "status: ok\n"
        "deduped: false\n"
        f"run_id: {new}\n"
        f"rerun_of: {first}\n"
        f"Run '{new}' created for workflow 'sync'; it supersedes run '{first}' under the same "
        "idempotency key (on_terminal_match). Ready for the agent: 'fetch'.\n"
    )
    shown = cli("run", "show", new)
    assert f"Rerun of: {first}\n" in shown.stdout
    assert "Phase: running" in shown.stdout
    listed = cli("run", "list", "--workflow", "sync", "--key", "k")
    assert listed.stdout.index(new) < listed.stdout.index(first)


def test_params_from_a_file_are_validated(cli, workdir: Path):
    (workdir / "p.json").write_text('{"repo": "o/r", "sha": "zzz"}')
    bad = cli("run", "start", "deploy", "--params", "@p.json")
    assert bad.returncode == 1
    assert bad.stdout.startswith("status: error\nVALIDATION_PARAMS: ")
    assert "$.sha" in bad.stdout
    (workdir / "p.json").write_text('{"repo": "o/r", "sha": "abcdef0"}')
    good = cli("run", "start", "deploy", "--params", "@p.json", "--json")
    assert json.loads(good.stdout)["next_step"] == "fetch"


def test_cancel_by_run_and_by_key_and_fail(cli):
    a = json.loads(cli("run", "start", "sync", "--key", "a", "--json").stdout)["run_id"]
    b = json.loads(cli("run", "start", "sync", "--key", "b", "--json").stdout)["run_id"]
    c = json.loads(cli("run", "start", "sync", "--json").stdout)["run_id"]
    assert cli("run", "cancel", a).stdout == "status: ok\ncancelled: 1\n"
    assert cli("run", "cancel", a).stdout == "status: ok\ncancelled: 0\n"
    assert cli("run", "cancel", "--workflow", "sync", "--key", "b").stdout.endswith(
        "cancelled: 1\n"
    )
    failed = cli("run", "fail", c, "--error", "disk full")
    assert failed.returncode == 0
    assert "Error: disk full" in cli("run", "show", c).stdout
    late = cli("run", "complete", b, "--step", "fetch")
    assert late.returncode == 1
    assert late.stdout.startswith("status: error\nSTATE_RUN_NOT_LIVE: ")
    assert "phase 'cancelled'" in late.stdout
    listed = json.loads(cli("run", "list", "--phase", "cancelled", "--json").stdout)
    assert {r["run_id"] for r in listed["runs"]} == {a, b}


def test_unknown_workflow_and_run(cli):
    out = cli("run", "start", "nope")
    assert out.returncode == 1
    assert out.stdout.startswith("status: error\nNOT_FOUND_WORKFLOW: Workflow 'nope'")
    out = cli("run", "show", "6c48086c-cb0f-47ea-9c33-6279fe42ffdc")
    assert out.stdout.startswith("status: error\nNOT_FOUND_RUN: ")


@pytest.mark.parametrize(
    ("yaml_text", "expected"),
    [
        ("version: 1\nworkflows:\n  w:\n    steps: []\n",
         "triggers.yaml: workflow 'w': field 'steps': must be a non-empty list of step names"),
        ("version: 1\nworkflows:\n  w:\n    steps: [a]\n    retention: 7 days\n",
         "triggers.yaml: workflow 'w': field 'retention': must be a duration like '7d', '36h' "
         "or '90m' (got '7 days')"),
        ("version: 1\nworkflows:\n  w:\n    steps: [a]\n    params_schema: {type: objekt}\n",
         "triggers.yaml: workflow 'w': field 'params_schema': not a valid JSON Schema at "
         "$.type: 'objekt' is not valid under any of the given schemas"),
        ("version: 1\nworkflows:\n  w:\n    stepz: [a]\n",
         "triggers.yaml: workflow 'w': field 'stepz': unknown field (did you mean 'steps'?); "
         "allowed fields: description, handlers, lease, max_attempts, params_schema, "
         "partitions, retention, retry_backoff, steps, stream_retention"),
        ("version: 2\nworkflows: {}\n", "triggers.yaml: field 'version' must be 1 (got 2)"),
        ("version: 1\nworkflows: [\n", "triggers.yaml: not valid YAML at line 3, column 1"),
    ],
)  # fmt: skip
def test_a_bad_config_gets_one_clear_line_and_exit_3(workdir: Path, yaml_text, expected):
    (workdir / "triggers.yaml").write_text(yaml_text)
    out = realm("run", "list", "--redis-url", "redis://127.0.0.1:1", cwd=workdir)
    assert out.returncode == 3
    assert out.stderr.startswith(f"error: {expected}")
    assert len(out.stderr.strip().splitlines()) == 1
    assert "Traceback" not in out.stderr


def test_an_unreachable_store_is_store_unavailable_not_a_traceback(workdir: Path):
    from tests.servers import free_port

    out = realm("run", "start", "sync", "--redis-url", f"redis://127.0.0.1:{free_port()}",
                cwd=workdir)  # fmt: skip
    assert out.returncode == 4
    assert (
        out.stdout == "status: error\nSTORE_UNAVAILABLE: Redis is unreachable: connection refused\n"
    )
    assert "Traceback" not in out.stderr
    # A batch whose outcome is unknown prints the batch id to retry with.
    (workdir / "items.json").write_text("[{}]")
    out = realm("run", "batch", "sync", "--items", "items.json", "--redis-url",
                f"redis://127.0.0.1:{free_port()}", cwd=workdir)  # fmt: skip
    assert out.returncode == 4
    assert re.fullmatch(
        rf"status: error\nSTORE_UNAVAILABLE: Redis is unreachable[^\n]*\nbatch_id: {UUID}\n",
        out.stdout,
    )


def test_the_cli_and_the_listener_say_an_unreachable_store_in_the_same_words(
    workdir: Path,
) -> None:
    url = f"redis://:pw-cli-words-4c1f@127.0.0.1:{free_port()}"
    out = realm("run", "list", "--redis-url", url, cwd=workdir)
    assert out.returncode == 4
    assert (
        out.stdout.splitlines()[1] == "STORE_UNAVAILABLE: Redis is unreachable: connection refused"
    )
    listener = Listener(workdir, WORKFLOWS_YAML, redis_url=url, args=("--log-format", "text"))
    try:
        log = listener.start().log()
    finally:
        listener.stop()
    # The start-up line (other parts may say it again as they start: the same words).
    (line,) = [line for line in log.splitlines() if line.startswith("error: Redis at ")]
    assert line.startswith("error: Redis at redis://:***@127.0.0.1:") and (
        "is unreachable: connection refused. Starting anyway: " in line
    ), line
    assert "pw-cli-words-4c1f" not in log + out.stdout + out.stderr


def test_reconcile_names_each_duplicate_group_s_key_escaped(cli):
    key = "order\n4417"  # a line break: printed escaped, never as a new line
    first = json.loads(cli("run", "start", "sync", "--key", key, "--json").stdout)["run_id"]
    cli("run", "fail", first)
    second = json.loads(
        cli("run", "start", "sync", "--key", key, "--on-terminal-match", "rerun", "--json").stdout
    )["run_id"]
    out = cli("run", "reconcile", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[2] == (
        f"  - workflow 'sync', key \"order\\n4417\" → canonical {second}; other runs: {first}"
    )


def test_batch_prints_one_line_per_item(cli, workdir: Path):
    existing = json.loads(cli("run", "start", "sync", "--key", "order-4417", "--json").stdout)
    (workdir / "items.json").write_text(json.dumps([
        {"params": {}, "idempotency_key": "order-21"},
        {"params": {}, "idempotency_key": "order-22"},
        {"params": {}, "idempotency_key": "order-4417"},
    ]))  # fmt: skip
    out = cli("run", "batch", "sync", "--items", "items.json")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "status: ok"
    assert re.fullmatch(rf"batch_id: {UUID}", lines[1])
    assert re.fullmatch(rf"order-21    run {UUID}  deduped: false", lines[2])
    assert re.fullmatch(rf"order-22    run {UUID}  deduped: false", lines[3])
    assert lines[4] == f"order-4417  run {existing['run_id']}  deduped: true"


def test_batch_with_a_bad_item_starts_nothing(cli, workdir: Path):
    (workdir / "items.json").write_text(json.dumps([
        {"params": {"repo": "o/r", "sha": "abcdef0"}, "idempotency_key": "a"},
        {"params": {"repo": "o/r"}, "idempotency_key": "b"},
    ]))  # fmt: skip
    out = cli("run", "batch", "deploy", "--items", "items.json")
    assert out.returncode == 1
    assert out.stdout == (
        "status: error\n"
        "VALIDATION_BATCH_ITEMS: start_run_batch: 1 item failed schema validation\n"
        "  - item 1: $: 'sha' is a required property\n"
        "One or more items failed schema validation. No runs were created.\n"
    )
    assert cli("run", "list").stdout == "no runs\n"


def test_reconcile_dry_run_prints_the_documented_report(cli):
    first = json.loads(cli("run", "start", "sync", "--key", "k", "--json").stdout)["run_id"]
    cli("run", "fail", first)
    second = json.loads(
        cli("run", "start", "sync", "--key", "k", "--on-terminal-match", "rerun", "--json").stdout
    )["run_id"]
    out = cli("run", "reconcile", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert out.stdout == (
        "Would write 0 pointers across 1 key group; 1 already current.\n"
        "Duplicate-key groups: 1\n"
        f"  - workflow 'sync', key k → canonical {second}; other runs: {first}\n"
    )


def test_a_retried_batch_with_its_batch_id_starts_nothing_twice(cli, workdir: Path):
    (workdir / "items.json").write_text(json.dumps([{"params": {}}, {"params": {}}]))
    first = cli("run", "batch", "sync", "--items", "items.json", "--batch-id", "nightly-7")
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.stdout.splitlines()[:2] == ["status: ok", "batch_id: nightly-7"]
    again = cli("run", "batch", "sync", "--items", "items.json", "--batch-id", "nightly-7")
    ids = re.findall(rf"run ({UUID})", first.stdout)
    assert len(ids) == 2 and re.findall(rf"run ({UUID})", again.stdout) == ids
    listed = json.loads(cli("run", "list", "--workflow", "sync", "--json").stdout)
    assert sorted(r["run_id"] for r in listed["runs"]) == sorted(ids)
    # Without --batch-id, one is made and printed, in the JSON reply too.
    made = json.loads(cli("run", "batch", "sync", "--items", "items.json", "--json").stdout)
    assert re.fullmatch(UUID, made["batch_id"]) and len(made["items"]) == 2


def test_on_params_mismatch_on_start_and_batch(cli, workdir: Path):
    first = cli("run", "start", "sync", "--key", "k", "--params", '{"n": 1}', "--json")
    run_id = json.loads(first.stdout)["run_id"]
    flagged = cli("run", "start", "sync", "--key", "k", "--params", '{"n": 2}')
    assert flagged.returncode == 0
    assert "params_mismatch: true\n" in flagged.stdout and run_id in flagged.stdout
    refused = cli("run", "start", "sync", "--key", "k", "--params", '{"n": 2}',
                  "--on-params-mismatch", "reject")  # fmt: skip
    assert refused.returncode == 1
    assert refused.stdout.startswith(
        f"status: error\nSTATE_IDEMPOTENCY_KEY_CONFLICT: Idempotency key for workflow 'sync' "
        f"is owned by run '{run_id}'"
    )
    (workdir / "items.json").write_text(json.dumps([{"params": {"n": 3}, "idempotency_key": "k"}]))
    batch = cli("run", "batch", "sync", "--items", "items.json",
                "--on-params-mismatch", "reject", "--json")  # fmt: skip
    assert json.loads(batch.stdout)["items"][0]["code"] == "STATE_IDEMPOTENCY_KEY_CONFLICT"
    bad = cli("run", "start", "sync", "--on-params-mismatch", "maybe")
    assert bad.returncode == 2 and "'maybe' is not one of 'flag', 'reject'" in bad.stderr


@pytest.mark.slow
def test_a_retried_start_with_its_request_id_starts_one_run(cli):
    first = cli("run", "start", "sync", "--request-id", "req-1", "--json")
    again = cli("run", "start", "sync", "--request-id", "req-1", "--json")
    assert first.returncode == again.returncode == 0, first.stdout + again.stdout
    assert json.loads(again.stdout)["run_id"] == json.loads(first.stdout)["run_id"]
    assert len(json.loads(cli("run", "list", "--json").stdout)["runs"]) == 1
    run_id = json.loads(first.stdout)["run_id"]
    done = cli("run", "complete", run_id, "--step", "fetch", "--request-id", "c-1")
    resent = cli("run", "complete", run_id, "--step", "fetch", "--request-id", "c-1")
    assert resent.returncode == 0 and resent.stdout == done.stdout
    cancelled = cli("run", "cancel", run_id, "--request-id", "x-1")
    assert (
        cli("run", "cancel", run_id, "--request-id", "x-1").stdout
        == cancelled.stdout
        == ("status: ok\ncancelled: 1\n")
    )


async def _start_runs(url: str, workflows: list[str]) -> list[str]:
    """Start one keyless run per entry, in order (in process: quicker than the CLI)."""
    from gateway.link.connection import redis_client
    from gateway.loading import parse_config
    from gateway.store.runstore import RunStore

    client = redis_client(url, 5.0)
    store = RunStore(client, parse_config(WORKFLOWS_YAML, with_triggers=False))
    try:
        params = {"repo": "o/r", "sha": "abcdef0"}
        return [
            (await store.start_run(w, params if w == "deploy" else {})).run_id for w in workflows
        ]
    finally:
        await client.aclose()


@pytest.mark.slow
def test_run_list_prints_a_header_and_pages_across_workflows(cli, redis_server):
    import asyncio

    order = ["sync", "single", "sync", "deploy", "single", "sync", "sync"]
    started = asyncio.run(_start_runs(redis_server.url, order))
    seen: list[str] = []
    cursor: list[str] = []
    pages = 0
    while pages < 10:
        out = cli("run", "list", "--limit", "3", *cursor)
        assert out.returncode == 0, out.stdout + out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].split() == ["RUN", "ID", "WORKFLOW", "PHASE", "STEP", "KEY"]
        assert lines[0].index("WORKFLOW") == lines[1].index(lines[1].split()[1])
        pages += 1
        more = re.fullmatch(r"More runs exist: pass --cursor (\S+) for the next page\.",
                            lines[-1])  # fmt: skip
        rows = lines[1:-1] if more else lines[1:]
        assert len(rows) == (3 if more else len(started) - len(seen))
        seen += [row.split()[0] for row in rows]
        if not more:
            break
        cursor = ["--cursor", more.group(1)]
    assert pages == 3
    # Each run once; newest first (runs started in the same millisecond in different
    # workflows may come in either order, but each workflow's own order is kept).
    assert sorted(seen) == sorted(started) and len(set(seen)) == len(seen)
    for workflow in set(order):
        mine = [run for run, w in zip(started, order, strict=True) if w == workflow]
        assert [run for run in seen if run in mine] == mine[::-1]
    # A page that shows the last run says nothing of more runs.
    whole = cli("run", "list", "--limit", "7").stdout.splitlines()
    assert len(whole) == 8 and not whole[-1].startswith("More")
    # One workflow; JSON carries the cursor too (null on the last page): the position
    # of the last run shown, as the HTTP API and MCP give it.
    page = json.loads(cli("run", "list", "--workflow", "sync", "--limit", "3", "--json").stdout)
    assert [r["run_id"] for r in page["runs"]] == [started[6], started[5], started[2]]
    assert re.fullmatch(rf"[0-9]{{16}}\.{started[2]}", page["cursor"])
    rest = cli("run", "list", "--workflow", "sync", "--cursor", page["cursor"], "--json")
    assert json.loads(rest.stdout) == {
        "runs": [json.loads(cli("run", "show", started[0], "--json").stdout)],
        "cursor": None,
    }
    for bad in ("²", "9223372036854775808", "sync:x", "nope:1", "3", f"1x.{started[0]}"):
        refused = cli("run", "list", "--limit", "3", "--cursor", bad)
        assert refused.returncode == 1
        assert refused.stdout.startswith("status: error\nVALIDATION_PARAMS: cursor must be ")
        assert "Traceback" not in refused.stderr


FORGED = f"x\nstatus: ok\nrun_id: {'6c48086c-cb0f-47ea-9c33-6279fe42ffdc'}\n\x1b[2K\x1b[1Aok"


@pytest.mark.slow
def test_keys_and_errors_cannot_forge_reply_lines(cli, workdir: Path):
    """A key or error text holding newlines and ANSI escapes is printed escaped (as a
    JSON string) in every text reply; a plain key is printed as it is."""
    escaped = json.dumps(FORGED)
    run_id = json.loads(cli("run", "start", "sync", "--key", FORGED, "--json").stdout)["run_id"]
    listed = cli("run", "list", "--workflow", "sync").stdout
    shown = cli("run", "show", run_id).stdout
    cli("run", "fail", run_id, "--error", FORGED)
    failed = cli("run", "show", run_id).stdout
    (workdir / "items.json").write_text(json.dumps([{"idempotency_key": FORGED}]))
    batch = cli("run", "batch", "sync", "--items", "items.json").stdout
    refused = cli("run", "start", FORGED).stdout
    for out in (listed, shown, failed, batch, refused):
        assert "\x1b" not in out
        assert [line for line in out.splitlines() if line.startswith("status:")] in (
            [],
            ["status: ok"],
            ["status: error"],
        ), out
        assert not any(line.startswith("run_id: 6c48086c") for line in out.splitlines()), out
    assert listed.splitlines()[1].endswith(f"running    fetch        {escaped}")
    assert f"Idempotency key: {escaped}\n" in shown
    assert f"Error: {escaped}\n" in failed
    assert batch.splitlines()[2].startswith(f"{escaped}  run {run_id}")
    assert refused.startswith("status: error\nNOT_FOUND_WORKFLOW: Workflow 'x\\nstatus: ok")
    plain = cli("run", "start", "sync", "--key", "order 4417/é", "--json")
    assert (
        "Idempotency key: order 4417/é\n"
        in cli("run", "show", json.loads(plain.stdout)["run_id"]).stdout
    )
