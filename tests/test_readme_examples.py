"""The README's examples run as written against the shipped triggers.yaml (issue #9, 15).

The shell blocks, the ``$ realm …`` commands and the Python block are taken from
README.md itself and run against a real ``realm listen`` on the shipped config
with its embedded server, in a copy of the repository's folder (port 8000 becomes
a free port). The payloads of ``examples/`` must pass ``realm triggers test``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.listener import Listener

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SHIPPED = ROOT / "triggers.yaml"
EXAMPLES = ROOT / "examples"
# The secrets the README's first command gives `realm listen`.
SECRETS = {
    "GITHUB_WEBHOOK_SECRET": "dev-github-secret",
    "STRIPE_WEBHOOK_SECRET": "whsec_dev",
    "REALM_TRIGGER_TOKEN": "dev-token",
}
API_TOKEN = "readme-api-token-5f1e9a"


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), re.M | re.S)


def shown_commands() -> list[str]:
    """The ``$ realm …`` commands of the README's sample sessions."""
    return re.findall(r"^    \$ (realm .+)$", README.read_text(), re.M)


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


def test_the_readme_names_only_workflows_and_files_that_exist() -> None:
    text = README.read_text()
    shipped = SHIPPED.read_text()
    for workflow in re.findall(r"realm run (?:start|batch) ([\w-]+)", text):
        if workflow != "WORKFLOW":
            assert re.search(rf"^  {re.escape(workflow)}:", shipped, re.M), workflow
    for name in re.findall(r"examples/([\w.-]+\.json)", text):
        assert (EXAMPLES / name).is_file(), name


@pytest.mark.slow
@pytest.mark.skipif(
    not (shutil.which("curl") and shutil.which("openssl") and shutil.which("bash")),
    reason="the README's shell examples use bash, curl and openssl",
)
def test_every_readme_example_runs_against_a_listener_on_the_shipped_config(
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
        assert commands, "the README shows `$ realm …` sessions"
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
