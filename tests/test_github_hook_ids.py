"""Several GitHub hooks posting one event to one path. GitHub sends the same
X-GitHub-Delivery to every hook of an event, so triggers keyed by it alone fold the
hooks' copies into one run: `realm triggers check` and `realm listen` warn about it,
and the layout docs/triggers.md shows (a trigger per hook's secret, keyed by
X-GitHub-Hook-ID and X-GitHub-Delivery) starts one run per hook, against a real
`realm listen` and a real Redis."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import redis as redis_sync
import yaml

from gateway.ingest.github_hooks import HOOK_KEY, shared_delivery_warnings
from gateway.ingest.triggers import parse_triggers
from gateway.store.keys import Keys
from tests.listener import Listener
from tests.servers import RedisServer
from tests.signing import github_headers

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "triggers.md"
SHIPPED = ROOT / "triggers.yaml"
PUSH = ROOT / "tests" / "payloads" / "github" / "push.json"

REPO_SECRET = "repo-hook-secret-7d1e"
ORG_SECRET = "org-hook-secret-3b9c"
HOOK_ENV = {"GITHUB_REPO_HOOK_SECRET": REPO_SECRET, "GITHUB_ORG_HOOK_SECRET": ORG_SECRET}
REPO_HOOK, ORG_HOOK = "480012345", "480067890"

WORKFLOWS = """version: 1
workflows:
  deploy: {steps: [fetch, build, release]}
  audit: {steps: [record]}
triggers:
"""

WARNING = (
    "warning: triggers.yaml: path /hooks/github: triggers 'github-push-repo' and "
    "'github-push-org' verify with different secrets (different hooks) but give workflow "
    "'deploy' the same key from X-GitHub-Delivery, which GitHub sends alike to every hook "
    "of an event: one hook's delivery joins the run another hook's started; put the hook "
    'id in both keys: key: "{header:X-GitHub-Hook-ID}:{header:X-GitHub-Delivery}"'
)


def docs_example() -> str:
    """The two-hook triggers of docs/triggers.md, as the page shows them."""
    page = DOCS.read_text()
    section = page.split("### Several GitHub hooks on one path", 1)[1]
    block = re.search(r"^```yaml\n(.*?)^```", section, re.M | re.S)
    assert block, "the section shows its triggers in a yaml block"
    return block.group(1)


def config(triggers: str) -> str:
    return WORKFLOWS + "".join(f"  {line}\n" if line else "\n" for line in triggers.splitlines())


SAFE = config(docs_example())
# The docs' layout without the hook id: what the warning is about.
RISKY = config(re.sub(r"^  key: .*\n", "", docs_example(), flags=re.M))


def realm(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("REALM_", "GITHUB_"))}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=cwd, env=full, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def check(tmp_path: Path, text: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "triggers.yaml").write_text(text)
    return realm("triggers", "check", *args, cwd=tmp_path, env=HOOK_ENV)


def warnings_of(triggers_yaml: str) -> list[str]:
    """shared_delivery_warnings of a `triggers:` mapping (the workflows above)."""
    compiled = parse_triggers(
        yaml.safe_load(triggers_yaml),
        file="triggers.yaml",
        workflows=("deploy", "audit"),
        env={**HOOK_ENV, "OTHER_SECRET": "x"},
    )
    return shared_delivery_warnings(compiled.values())


def trigger(name: str, secret: str, *, key: str | None = None, extra: str = "",
            workflow: str = "deploy", event_id: str = "X-GitHub-Delivery") -> str:  # fmt: skip
    lines = [
        f"{name}:",
        f"  workflow: {workflow}",
        "  path: /hooks/github",
        f"  verify: {{scheme: github, secret_env: {secret}}}",
        f"  event_id: {{header: {event_id}}}",
    ]
    if key is not None:
        lines.append(f'  key: "{key}"')
    return "\n".join(lines) + "\n" + extra


# --------------------------------------------------------------------------- realm triggers check


def test_check_warns_about_two_hooks_keyed_by_the_delivery_id_alone(tmp_path: Path) -> None:
    out = check(tmp_path, RISKY)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "triggers.yaml: ok: 2 workflows, 2 triggers"
    assert out.stderr.splitlines() == [WARNING]
    # CI checks without the secrets: the warning is about names, so it comes there too.
    ci = realm("triggers", "check", "--no-secrets", cwd=tmp_path, env={})
    assert ci.returncode == 0, ci.stderr
    assert ci.stderr.splitlines() == [WARNING]


def test_the_docs_warning_is_the_one_check_prints() -> None:
    assert "    " + WARNING in DOCS.read_text().splitlines()


@pytest.mark.parametrize(
    "text",
    [
        SAFE,  # the hook id in each key, as the docs show
        RISKY.replace("GITHUB_ORG_HOOK_SECRET", "GITHUB_REPO_HOOK_SECRET"),  # one secret
        config(docs_example().split("github-push-org:")[0]),  # one trigger
        SHIPPED.read_text(),
    ],
    ids=["hook-id-in-the-key", "same-secret", "one-trigger", "shipped"],
)
def test_check_prints_no_warning_for_a_safe_config(tmp_path: Path, text: str) -> None:
    env = {**HOOK_ENV, "GITHUB_WEBHOOK_SECRET": "s", "STRIPE_WEBHOOK_SECRET": "whsec_c2VjcmV0",
           "REALM_TRIGGER_TOKEN": "t"}  # fmt: skip
    (tmp_path / "triggers.yaml").write_text(text)
    out = realm("triggers", "check", cwd=tmp_path, env=env)
    assert (out.returncode, out.stderr) == (0, ""), out.stderr
    assert out.stdout.splitlines()[-1].startswith("triggers.yaml: ok: ")


# --------------------------------------------------------------------------- the rule itself


REPO = "GITHUB_REPO_HOOK_SECRET"
ORG = "GITHUB_ORG_HOOK_SECRET"


def test_a_key_reading_the_delivery_id_either_way_is_the_same_key() -> None:
    """`{event_id}` from X-GitHub-Delivery and `{header:X-GitHub-Delivery}` give one event
    one key, whatever the header name's case."""
    found = warnings_of(
        trigger("a", REPO, key="gh:{event_id}")
        + trigger("b", ORG, key="gh:{header:x-github-delivery}")
    )
    assert len(found) == 1 and found[0].startswith("path /hooks/github: triggers 'a' and 'b' ")


def test_three_hooks_are_named_in_one_warning() -> None:
    found = warnings_of(trigger("a", REPO) + trigger("b", ORG) + trigger("c", "[OTHER_SECRET]"))
    assert len(found) == 1
    assert found[0].startswith("path /hooks/github: triggers 'a', 'b' and 'c' verify ")
    assert found[0].endswith(f'put the hook id in each key: key: "{HOOK_KEY}"')


@pytest.mark.parametrize(
    "triggers",
    [
        # The other hook-identifying header in the key.
        trigger("a", REPO, key="{header:X-GitHub-Hook-Installation-Target-ID}:{event_id}")
        + trigger("b", ORG, key="{header:X-GitHub-Hook-Installation-Target-ID}:{event_id}"),
        # Different keys: a literal per hook keeps them apart too.
        trigger("a", REPO, key="repo:{event_id}") + trigger("b", ORG, key="org:{event_id}"),
        # Different workflows: a key belongs to one workflow.
        trigger("a", REPO) + trigger("b", ORG, workflow="audit"),
        # Never the same event: one takes pushes, the other pull requests.
        trigger("a", REPO, extra="  when: [{header: X-GitHub-Event, equals: push}]\n")
        + trigger("b", ORG, extra="  when: [{header: x-github-event, in: [pull_request]}]\n"),
        # A key from the payload (a pull request), not the delivery id.
        trigger("a", REPO, key="pr:{$.number}") + trigger("b", ORG, key="pr:{$.number}"),
        # Another sender's event id.
        trigger("a", REPO, event_id="X-Other-Id") + trigger("b", ORG, event_id="X-Other-Id"),
    ],
    ids=["target-id", "own-literal", "other-workflow", "push-vs-pr", "payload-key", "other-id"],
)
def test_keys_that_cannot_meet_draw_no_warning(triggers: str) -> None:
    assert warnings_of(triggers) == []


def test_a_when_on_the_hook_id_does_not_keep_two_hooks_apart() -> None:
    """Each hook's copy of an event carries its own hook id: a `when` on it says which
    hook a trigger takes, not which events, so the keys still meet."""
    found = warnings_of(
        trigger("a", REPO, extra="  when: [{header: X-GitHub-Hook-ID, equals: '1'}]\n")
        + trigger("b", ORG, extra="  when: [{header: X-GitHub-Hook-ID, equals: '2'}]\n")
    )
    assert len(found) == 1


# --------------------------------------------------------------------------- end to end


def push_body() -> bytes:
    doc = json.loads(PUSH.read_bytes())
    doc["after"] = uuid.uuid4().hex + uuid.uuid4().hex[:8]
    return json.dumps(doc).encode()


def post(http: httpx.Client, body: bytes, secret: str, delivery: str, hook: str | None):
    extra = {} if hook is None else {"X-GitHub-Hook-ID": hook}
    headers = github_headers(body, secret, delivery=delivery, **extra)
    return http.post("/hooks/github", content=body, headers=headers)


def outcome(reply: httpx.Response) -> tuple[int, list[tuple[str, str, str | None]]]:
    return reply.status_code, [
        (r["trigger"], r["outcome"], r["run_id"]) for r in reply.json()["results"]
    ]


def runs_of(db: redis_sync.Redis, workflow: str) -> list[str]:
    return db.zrange(Keys("realm", workflow).runs(), 0, -1)


def logged_warnings(listener: Listener) -> list[str]:
    lines = [json.loads(line) for line in listener.log().splitlines() if line.startswith("{")]
    return [line["message"] for line in lines if line.get("level") == "warning"]


def test_each_hook_starts_its_own_run_and_each_redelivery_none(
    tmp_path: Path, module_redis: RedisServer, db: redis_sync.Redis
) -> None:
    listener = Listener(tmp_path, SAFE, redis_url=module_redis.url, env=HOOK_ENV).start()
    try:
        body, delivery = push_body(), str(uuid.uuid4())
        with httpx.Client(base_url=listener.base_url, timeout=10) as http:
            first = post(http, body, REPO_SECRET, delivery, REPO_HOOK)
            status, [(name, what, repo_run)] = outcome(first)
            assert (status, name, what) == (202, "github-push-repo", "started"), first.text
            second = post(http, body, ORG_SECRET, delivery, ORG_HOOK)
            status, [(name, what, org_run)] = outcome(second)
            assert (status, name, what) == (202, "github-push-org", "started"), second.text
            assert org_run != repo_run

            # GitHub's redeliveries, from each hook: the run that hook's delivery got.
            assert outcome(post(http, body, REPO_SECRET, delivery, REPO_HOOK)) == (
                200, [("github-push-repo", "deduplicated", repo_run)])  # fmt: skip
            assert outcome(post(http, body, ORG_SECRET, delivery, ORG_HOOK)) == (
                200, [("github-push-org", "deduplicated", org_run)])  # fmt: skip
            # A captured delivery sent again under another (unsigned) hook id: the
            # trigger's record of the event id deduplicates it.
            assert outcome(post(http, body, REPO_SECRET, delivery, "999")) == (
                200, [("github-push-repo", "deduplicated", repo_run)])  # fmt: skip
            # No hook id (not GitHub): refused, saying which key part is missing.
            bare = post(http, push_body(), REPO_SECRET, str(uuid.uuid4()), None)
            assert bare.status_code == 422, bare.text
            [refused] = bare.json()["results"]
            assert (refused["code"], refused["message"]) == (
                "VALIDATION_EVENT_ID",
                f"key part {{header:X-GitHub-Hook-ID}} of key template '{HOOK_KEY}' has no value",
            )
        assert sorted(runs_of(db, "deploy")) == sorted([repo_run, org_run])
        assert db.xlen(Keys("realm", "deploy").stream()) == 2
    finally:
        listener.stop()
    assert logged_warnings(listener) == []


def test_listen_warns_at_start_up_and_the_hooks_fold_as_it_says(
    tmp_path: Path, module_redis: RedisServer, db: redis_sync.Redis
) -> None:
    listener = Listener(tmp_path, RISKY, redis_url=module_redis.url, env=HOOK_ENV).start()
    try:
        assert logged_warnings(listener) == [WARNING.removeprefix("warning: triggers.yaml: ")]
        body, delivery = push_body(), str(uuid.uuid4())
        with httpx.Client(base_url=listener.base_url, timeout=10) as http:
            status, [(_, what, run)] = outcome(post(http, body, REPO_SECRET, delivery, REPO_HOOK))
            assert (status, what) == (202, "started")
            # The organisation hook's copy of the same push: deduplicated, no run of its own.
            assert outcome(post(http, body, ORG_SECRET, delivery, ORG_HOOK)) == (
                200, [("github-push-org", "deduplicated", run)])  # fmt: skip
        assert runs_of(db, "deploy") == [run]
    finally:
        listener.stop()


def test_the_shipped_config_starts_one_deploy_per_push_whichever_hooks_send_it(
    tmp_path: Path, module_redis: RedisServer, db: redis_sync.Redis
) -> None:
    """Its one GitHub secret: a second hook's copy is what a replay under another hook id
    would be, so it joins the first one's run (as its comment and the docs say)."""
    secret = "shipped-github-secret"
    env = {"GITHUB_WEBHOOK_SECRET": secret, "STRIPE_WEBHOOK_SECRET": "whsec_c2VjcmV0",
           "REALM_TRIGGER_TOKEN": "shipped-token"}  # fmt: skip
    listener = Listener(tmp_path, SHIPPED.read_text(), redis_url=module_redis.url, env=env)
    listener.start()
    try:
        doc = json.loads(PUSH.read_bytes())
        doc["ref"], doc["after"] = "refs/heads/main", uuid.uuid4().hex + uuid.uuid4().hex[:8]
        body, delivery = json.dumps(doc).encode(), str(uuid.uuid4())
        with httpx.Client(base_url=listener.base_url, timeout=10) as http:
            status, results = outcome(post(http, body, secret, delivery, REPO_HOOK))
            assert status == 202 and results[0][:2] == ("github-push", "started")
            run = results[0][2]
            status, results = outcome(post(http, body, secret, delivery, ORG_HOOK))
            assert (status, results[0]) == (200, ("github-push", "deduplicated", run))
        assert runs_of(db, "deploy") == [run]
    finally:
        listener.stop()
    assert logged_warnings(listener) == []
