"""The README's and the docs' examples run as written against the shipped triggers.yaml.

The ``sh`` blocks, the ``$ realm …`` commands and the ``python`` blocks are taken
from README.md and docs/*.md themselves (in that order: README first, then the docs
pages by name) and run against a real ``realm listen`` on the shipped config with its
embedded server, in a copy of the repository's folder (port 8000 becomes a free
port). All ``sh`` blocks run first, as one script, then every ``$ realm …`` command,
then each ``python`` block, twice. So a block fenced as ``sh`` or ``python`` in any of
these pages must run as written; syntax meant only to be read goes in an indented
block. The payloads of ``examples/`` must pass ``realm triggers test``.

The pages are also held to what a reader can follow: every relative link and anchor
resolves, Python examples import only the public face (``from gateway import …``),
and no page points at what is not in the repository (issue numbers, design-section
numbers, commit hashes, work in progress).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from tests.listener import Listener

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
SHIPPED = ROOT / "triggers.yaml"
EXAMPLES = ROOT / "examples"
# The secrets the README's first command gives `realm listen`.
SECRETS = {
    "GITHUB_WEBHOOK_SECRET": "dev-github-secret",
    "STRIPE_WEBHOOK_SECRET": "whsec_dev",
    "REALM_TRIGGER_TOKEN": "dev-token",
}
API_TOKEN = "readme-api-token-5f1e9a"


def pages() -> list[Path]:
    """The pages whose examples run: the README, then docs/ by name."""
    return [README, *sorted(DOCS.glob("*.md"))]


def every_page() -> list[Path]:
    """Every page a reader may open: those above, and the other folders' READMEs."""
    return [*pages(), ROOT / "bench" / "README.md", EXAMPLES / "README.md"]


def blocks(language: str) -> list[str]:
    return [
        block
        for page in pages()
        for block in re.findall(rf"^```{language}\n(.*?)^```", page.read_text(), re.M | re.S)
    ]


def shown_commands() -> list[str]:
    """The ``$ realm …`` commands of the pages' sample sessions."""
    return [
        command
        for page in pages()
        for command in re.findall(r"^    \$ (realm .+)$", page.read_text(), re.M)
    ]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REALM_")}
    env.update(extra)
    # `realm` as the README writes it: this interpreter's entry point.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def copy_of_repo(tmp_path: Path) -> Path:
    work = tmp_path / "repo"
    work.mkdir()
    shutil.copy(SHIPPED, work / "triggers.yaml")
    shutil.copytree(EXAMPLES, work / "examples")
    return work


@pytest.mark.parametrize(
    ("body", "path", "headers", "trigger", "params"),
    [
        (
            "github-push.json",
            "/hooks/github",
            ["X-GitHub-Event: push", "X-GitHub-Delivery: ex-1"],
            "github-push",
            {"repo": "octo-org/shop-api", "sha": "9b2e7d4f1a6c3e8b5d0f2a7c4e9b1d6f3a8c5e07"},
        ),
        (
            "github-pull_request.opened.json",
            "/hooks/github",
            ["X-GitHub-Event: pull_request", "X-GitHub-Delivery: ex-2"],
            "github-preview",
            {
                "repo": "octo-org/shop-api",
                "number": 42,
                "sha": "3c8e1f5a9d2b7c4e0a6f8b1d3e5c7a9f2b4d6e80",
            },
        ),
        (
            "stripe-invoice.paid.json",
            "/hooks/stripe",
            [],
            "stripe-billing",
            {"event_type": "invoice.paid", "customer": "cus_R7kL2mN4pQ6sT8"},
        ),
    ],
)
def test_example_payloads_pass_triggers_test_with_the_shipped_config(
    tmp_path: Path, body: str, path: str, headers: list[str], trigger: str, params: dict
) -> None:
    args = [sys.executable, "-m", "gateway", "triggers", "test", "--config", str(SHIPPED),
            "--path", path, "--body", str(EXAMPLES / body), "--sign", "--json",
            "--data-dir", str(tmp_path / "data")]  # fmt: skip
    for header in headers:
        args += ["--header", header]
    out = subprocess.run(
        args, env=clean_env(**SECRETS), capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    report = {t["trigger"]: t for t in json.loads(out.stdout)["triggers"]}
    assert report[trigger]["signature"] == "ok"
    assert report[trigger]["matched"] is True, report[trigger]
    assert report[trigger]["params"] == params
    assert report[trigger]["result"] == "a claim now would start a new run"
    others = [t for name, t in report.items() if name != trigger]
    assert all(not t["matched"] for t in others), others


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_pages_name_only_workflows_and_files_that_exist(page: Path) -> None:
    text = page.read_text()
    shipped = SHIPPED.read_text()
    for workflow in re.findall(r"realm run (?:start|batch) ([\w-]+)", text):
        if workflow != "WORKFLOW":
            assert re.search(rf"^  {re.escape(workflow)}:", shipped, re.M), workflow
    for name in re.findall(r"examples/([\w.-]+\.json)", text):
        assert (EXAMPLES / name).is_file(), name


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to -."""
    kept = (
        c
        for c in heading.strip().lower()
        if c in " -" or unicodedata.category(c)[0] in "LMN" or unicodedata.category(c) == "Pc"
    )
    return "".join(kept).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


@pytest.mark.parametrize("page", every_page(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{target}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{target}: no heading with that anchor in {where.name}")
    assert not broken, broken


# What a reader cannot follow: numbers of issues and design sections, commit
# hashes, documents outside the repository, and work in progress.
ELSEWHERE = [
    (r"(?<![\w{])#\d+\b", "an issue number"),
    (r"\bissues? \d+", "an issue number"),
    (r"§|\bDESIGN\b", "a design-section reference"),
    (r"\.\./shared|perf-notes", "a file outside the repository"),
    (r"\bcommit `?[0-9a-f]{7,40}\b", "a commit hash"),
    (r"`(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}`", "a commit hash"),
    (r"\buncommitted\b|\bnot yet committed\b|\bthis session\b", "work in progress"),
    (r"\bworking tree\b", "work in progress"),
]


@pytest.mark.parametrize("page", every_page(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_points_outside_the_repository(page: Path) -> None:
    found = [
        f"{page.name}:{number}: {what}: {line.strip()[:100]}"
        for number, line in enumerate(page.read_text().splitlines(), 1)
        for pattern, what in ELSEWHERE
        if re.search(pattern, line, re.I if what == "work in progress" else 0)
    ]
    assert not found, "\n".join(found)


def test_python_examples_use_the_public_face() -> None:
    python = blocks("python")
    assert python, "the pages show Python examples"
    for block in python:
        for line in block.splitlines():
            if re.match(r"\s*(from|import) gateway\b", line):
                assert line.strip().startswith("from gateway import "), line


@pytest.mark.slow
@pytest.mark.skipif(
    not (shutil.which("curl") and shutil.which("openssl") and shutil.which("bash")),
    reason="the pages' shell examples use bash, curl and openssl",
)
def test_every_example_runs_against_a_listener_on_the_shipped_config(
    tmp_path: Path,
) -> None:
    work = copy_of_repo(tmp_path)
    listener = Listener(
        work, SHIPPED.read_text(), redis_url=None, env={**SECRETS, "REALM_API_TOKEN": API_TOKEN}
    ).start()
    env = clean_env(**SECRETS, REALM_API_TOKEN=API_TOKEN)
    try:
        port = str(listener.port)
        script = "\n".join(
            # The listener already has its API token; the example's own export
            # would make another one.
            line.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
            for block in blocks("sh")
            for line in block.splitlines()
            if not line.startswith("export REALM_API_TOKEN=")
        )
        shell = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=work, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert shell.returncode == 0, shell.stdout + shell.stderr
        # A reply body ends without a newline: the next status line follows it.
        statuses = re.findall(r"HTTP/1\.1 (\d{3}) ", shell.stdout)
        assert len(statuses) == script.count("curl -i"), shell.stdout
        assert all(s.startswith("2") for s in statuses), shell.stdout
        assert '"status":"error"' not in shell.stdout, shell.stdout
        assert "signature: ok" in shell.stdout and "would start a new run" in shell.stdout

        commands = shown_commands()
        assert commands, "the pages show `$ realm …` sessions"
        for command in commands:
            out = subprocess.run(
                ["bash", "-c", command], cwd=work, env=env,
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert out.returncode == 0, f"{command}\n{out.stdout}{out.stderr}"
            assert "status: error" not in out.stdout, f"{command}\n{out.stdout}"

        for python in blocks("python"):
            for attempt in range(2):  # the example may be run again, as a user would
                out = subprocess.run(
                    [sys.executable, "-c", python], cwd=work, env=env,
                    capture_output=True, text=True, timeout=60,
                )  # fmt: skip
                assert out.returncode == 0, f"attempt {attempt + 1}:\n{out.stderr}"
    finally:
        listener.stop()
    assert "Traceback" not in listener.log(), listener.log()[-3000:]
