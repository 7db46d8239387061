"""Reloading as the deploy files set it up, run here against a real `realm listen`:

- systemd: `systemctl reload` runs the unit's ExecReload in the unit's environment;
  it must find the listener ExecStart started and fail when the listener refuses.
- Kubernetes: `kubectl exec <pod> -- realm triggers reload` runs in the container's
  environment; after the kubelet swaps the ConfigMap's file, it must find the
  listener (its pid file on the writable /tmp) and have it serve the new text.
- Compose: `docker compose exec gateway-1 realm triggers reload` runs in the service's
  environment; after the bind-mounted file is overwritten in place, it must find the
  listener (its pid file on the tmpfs) and have it serve the new text.
- The docs and the files' comments say the same about it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis as redis_sync

from tests.servers import RedisServer, free_port
from tests.test_deploy import GATEWAY, compose, image_env, k8s_documents, pod_spec, unit_settings
from tests.test_reload import (
    ENV,
    V1,
    V2,
    config,
    configmap_volume,
    version,
    wait_until,
    write,
)

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Started:
    """`realm listen` as a service manager starts it: its arguments, its environment."""

    process: subprocess.Popen[bytes]
    env: dict[str, str]
    cwd: Path
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def realm(self, *args: str) -> subprocess.CompletedProcess[str]:
        """A command run in the same environment (as ExecReload, or `kubectl exec`)."""
        return subprocess.run([sys.executable, "-m", "gateway", *args], cwd=self.cwd,
                              env=self.env, capture_output=True, text=True, timeout=60)  # fmt: skip

    def readyz_version(self) -> str:
        reply = httpx.get(f"http://127.0.0.1:{self.env['REALM_PORT']}/readyz", timeout=5)
        return str(reply.json()["config_version"])


@pytest.fixture
def service(db: redis_sync.Redis) -> Iterator[list[Started]]:
    started: list[Started] = []
    yield started
    for one in started:
        if one.process.poll() is None:
            one.process.send_signal(signal.SIGTERM)
            one.process.wait(timeout=40)


def run_listen(started: list[Started], args: list[str], env: dict[str, str], cwd: Path) -> Started:
    cwd.mkdir(parents=True, exist_ok=True)
    log_path = cwd / "listen.log"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("REALM_")}
    env = {**clean, **ENV, **env}
    with log_path.open("ab") as log:
        process = subprocess.Popen([sys.executable, "-m", "gateway", *args], cwd=cwd, env=env,
                                   stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    one = Started(process, env, cwd, log_path)
    started.append(one)
    workers = int(env.get("REALM_WORKERS", "1"))
    wait_until(
        f"{workers} worker(s) to serve",
        lambda: (
            one.log().count("Application startup complete.") == workers
            or process.poll() is not None
        ),
        timeout=30,
    )
    assert process.poll() is None, one.log()
    return one


def test_systemctl_reload_reports_what_the_listener_did(
    tmp_path: Path, module_redis: RedisServer, service: list[Started]
) -> None:
    settings = unit_settings()
    exec_start = settings["ExecStart"][0].split()
    exec_reload = settings["ExecReload"][0].split()
    # The gateway's own command, so that a refusal fails `systemctl reload`.
    assert exec_reload[0] == exec_start[0] and exec_reload[1:] == ["triggers", "reload"]
    env = dict(e.split("=", 1) for e in settings["Environment"])
    # The unit's environment, its paths moved under tmp_path and a free port.
    config_file = tmp_path / env["REALM_CONFIG"].lstrip("/")
    config_file.parent.mkdir(parents=True)
    config_file.write_text(V1)
    env["REALM_CONFIG"] = str(config_file)
    env["REALM_DATA_DIR"] = str(tmp_path / env["REALM_DATA_DIR"].lstrip("/"))
    env["REALM_PORT"] = str(free_port())
    env["REALM_REDIS_URL"] = module_redis.url  # from realm.env
    cwd = tmp_path / settings["WorkingDirectory"][0].lstrip("/")
    listener = run_listen(service, exec_start[1:], env, cwd)
    pid = listener.process.pid

    write(config_file, V2)
    done = listener.realm(*exec_reload[1:])
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.endswith(f"realm listen (pid {pid}) applied it: it serves version "
                                f"{version(V2)}\n")  # fmt: skip
    wait_until("V2 to serve", lambda: listener.readyz_version() == version(V2))

    refused = config(("a", "c"), other="/hooks/new", settings="settings: {key_prefix: x}\n")
    write(config_file, refused)
    no = listener.realm(*exec_reload[1:])
    assert no.returncode == 3, no
    assert no.stderr == (
        f"error: realm listen (pid {pid}) refused the file: {config_file}: settings.key_prefix "
        "changed (was 'realm', now 'x'); restart the listener to apply it; it still serves "
        f"version {version(V2)}\n"
    )


def test_kubectl_exec_reload_serves_the_updated_configmap(
    tmp_path: Path, module_redis: RedisServer, service: list[Started]
) -> None:
    spec = pod_spec(k8s_documents()[GATEWAY])
    (container,) = spec["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    # The pid file is on a writable volume (the root file system is read-only).
    pid_dir = os.path.dirname(env["REALM_PID_FILE"])
    assert "emptyDir" in volumes[mounts[pid_dir]]
    # triggers.yaml is the ConfigMap's volume, mounted whole (a subPath is never updated).
    config_dir = os.path.dirname(env["REALM_CONFIG"])
    assert "configMap" in volumes[mounts[config_dir]]
    assert not any("subPath" in m for m in container["volumeMounts"])

    # The container's environment, its folders moved under tmp_path.
    root = tmp_path / "pod"
    volume = root / config_dir.lstrip("/")
    volume.mkdir(parents=True)
    configmap_volume(volume, V1)
    (root / pid_dir.lstrip("/")).mkdir(parents=True)
    env["REALM_CONFIG"] = str(root / env["REALM_CONFIG"].lstrip("/"))
    env["REALM_PID_FILE"] = str(root / env["REALM_PID_FILE"].lstrip("/"))
    env["REALM_PORT"] = str(free_port())
    env["REALM_REDIS_URL"] = module_redis.url  # from the Secret
    listener = run_listen(service, ["listen", "--host", "127.0.0.1"], env, root / "var")

    # The kubelet swaps in the new version; until told, the pod serves the old one.
    configmap_volume(volume, V2)
    assert listener.readyz_version() == version(V1)
    done = listener.realm("triggers", "reload")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == (
        f"{env['REALM_CONFIG']}: ok (version {version(V2)})\n"
        f"realm listen (pid {listener.process.pid}) applied it: it serves version "
        f"{version(V2)}\n"
    )
    assert listener.readyz_version() == version(V2)


def test_compose_exec_reload_serves_the_file_overwritten_in_place(
    tmp_path: Path, module_redis: RedisServer, service: list[Started]
) -> None:
    gateway = compose()["services"]["gateway-1"]
    # The container's environment: the image's ENV under the service's environment.
    env = {**image_env(), **gateway["environment"]}
    (bind,) = [v for v in gateway["volumes"] if v["type"] == "bind"]
    assert bind["target"] == env["REALM_CONFIG"] and bind["read_only"]
    # The pid file is on the tmpfs: the root file system is read-only.
    assert gateway["read_only"] is True
    pid_dir = os.path.dirname(env["REALM_PID_FILE"])
    assert pid_dir in gateway["tmpfs"]

    # Its folders moved under tmp_path.
    root = tmp_path / "container"
    config_file = root / env["REALM_CONFIG"].lstrip("/")
    config_file.parent.mkdir(parents=True)
    config_file.write_text(V1)
    (root / pid_dir.lstrip("/")).mkdir(parents=True)
    for name in ("REALM_CONFIG", "REALM_PID_FILE", "REALM_DATA_DIR"):
        env[name] = str(root / env[name].lstrip("/"))
    env["REALM_PORT"] = str(free_port())
    env["REALM_REDIS_URL"] = module_redis.url  # the service's, pointed at the test's Redis
    listener = run_listen(service, ["listen", "--host", "127.0.0.1"], env, root / "work")

    # `cp my-triggers.yaml triggers.yaml`: the same file (the bind mount's), new text.
    inode = config_file.stat().st_ino
    with config_file.open("w") as file:
        file.write(V2)
    assert config_file.stat().st_ino == inode
    assert listener.readyz_version() == version(V1)
    done = listener.realm("triggers", "reload")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == (
        f"{env['REALM_CONFIG']}: ok (version {version(V2)})\n"
        f"realm listen (pid {listener.process.pid}) applied it: it serves version "
        f"{version(V2)}\n"
    )
    assert listener.readyz_version() == version(V2)


def test_the_docs_say_the_same_about_reloading() -> None:
    """Each place that tells an operator how to reload names the same ways."""
    operating = (ROOT / "docs" / "operating.md").read_text()
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    unit = (ROOT / "deploy" / "systemd" / "realm-gateway.service").read_text()
    configmap = (ROOT / "deploy" / "k8s" / "configmap.yaml").read_text()
    compose_file = (ROOT / "deploy" / "compose.yaml").read_text()
    for name, text in [("operating.md", operating), ("deploy.md", deploy), ("unit", unit),
                       ("configmap.yaml", configmap)]:  # fmt: skip
        assert "realm triggers reload" in text, name
    for name, text in [("operating.md", operating), ("deploy.md", deploy)]:
        assert "SIGHUP" in text and "systemctl reload" in text, name
    for name, text in [("deploy.md", deploy), ("configmap.yaml", configmap)]:
        assert "kubectl rollout restart statefulset/realm-gateway" in text, name
        assert "kubectl exec <pod> -- realm triggers reload" in text, name
    for name, text in [("deploy.md", deploy), ("compose.yaml", compose_file)]:
        assert "docker compose -f deploy/compose.yaml exec gateway-1 realm triggers reload" in (
            text
        ), name
