"""Reading ``triggers.yaml``: its YAML, its workflows and settings (the model's
parsers), its triggers (ingest) and its workflows' handlers (runners), checked
together. Every error is a ``ConfigError`` naming the file, the entry and the field;
commands that only start or manage runs load the workflows alone
(``with_triggers=False``), so they need none of the webhook secrets.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from gateway.ingest.triggers import Trigger, parse_triggers
from gateway.model.config import RESERVED_PATHS, Config, Workflow
from gateway.model.errors import ConfigError
from gateway.model.parse import clip, parse_settings, parse_workflows
from gateway.model.words import did_you_mean, noun
from gateway.runners.handlers import parse_handlers
from gateway.signatures.schemes import PLACEHOLDER_SECRET

TOP_FIELDS = {"version", "workflows", "triggers", "settings"}


def load_config(
    path: str | os.PathLike[str],
    *,
    with_triggers: bool = True,
    env: Mapping[str, str] | None = None,
) -> Config[Trigger]:
    """Read and check a ``triggers.yaml``. Raises ``ConfigError`` on any problem."""
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(file, "file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(file, f"cannot read file: {exc}") from None
    return parse_config(text, file=file, with_triggers=with_triggers, env=env)


class _PlaceholderSecrets(Mapping[str, str]):
    """An environment in which every variable holds the same placeholder secret, one
    that also fits the Standard Webhooks format: the file is checked, not the
    environment of the machine it is checked on (a CI job has no production secrets).
    The placeholder never verifies anything: such a config is for checking only."""

    def __getitem__(self, name: str) -> str:
        return PLACEHOLDER_SECRET

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def load_config_without_secrets(path: str | os.PathLike[str]) -> Config[Trigger]:
    """Every check of ``load_config`` except that the secrets' variables are set (and
    that a Standard Webhooks one holds a ``whsec_`` secret): ``realm triggers check
    --no-secrets``. Its triggers hold placeholder secrets: check with it, never serve."""
    return load_config(path, env=_PlaceholderSecrets())


def secret_variables(config: Config[Trigger]) -> dict[str, list[str]]:
    """Each ``secret_env`` variable of the config's triggers, with the triggers that
    name it, in the order of the file."""
    users: dict[str, list[str]] = {}
    for trigger in config.triggers.values():
        for name in trigger.verify.secret_env:
            users.setdefault(name, []).append(trigger.name)
    return users


def parse_config(
    text: str,
    *,
    file: str = "triggers.yaml",
    with_triggers: bool = True,
    env: Mapping[str, str] | None = None,
) -> Config[Trigger]:
    doc = load_yaml(text, file)
    if not isinstance(doc, dict):
        raise ConfigError(file, "must be a mapping with 'version', 'workflows' and 'triggers'")
    unknown = [str(k) for k in doc if k not in TOP_FIELDS]
    if unknown:
        named = ", ".join(clip(repr(k), 60) + did_you_mean(k, TOP_FIELDS) for k in unknown)
        raise ConfigError(
            file,
            f"unknown top-level {noun(len(unknown), 'field')} {clip(named)}; "
            f"allowed fields: {', '.join(sorted(TOP_FIELDS))}",
        )
    version = doc.get("version")
    if version is None:  # absent, or `version:` with no value
        problem = "is missing" if "version" not in doc else "has no value"
        raise ConfigError(file, f"field 'version' {problem}; write 'version: 1' at the top")
    if type(version) is not int or version != 1:  # `version: true` is not 1
        raise ConfigError(file, f"field 'version' must be 1 (got {clip(repr(version))})")
    workflows = parse_workflows(doc.get("workflows"), file)
    _check_handlers(workflows, file, doc.get("triggers"))
    settings = parse_settings(doc.get("settings"), file)
    triggers: Mapping[str, Trigger] = {}
    if with_triggers and doc.get("triggers") is not None:
        triggers = parse_triggers(
            doc["triggers"],
            file=file,
            workflows=workflows.keys(),
            env=os.environ if env is None else env,
        )
        for trigger in triggers.values():
            if trigger.replay_guard and workflows[trigger.workflow].partitions > 1:
                # The guard's record of a body must sit in the slot of the claim that
                # checks it; a replay under another event id has another key, so on a
                # partitioned workflow it would be claimed in another partition.
                raise ConfigError(
                    file,
                    f"replay_guard (on by default for github and shopify) needs workflow "
                    f"'{trigger.workflow}' in one partition; set replay_guard: false or "
                    "remove the workflow's partitions",
                    section="trigger",
                    name=trigger.name,
                    field="replay_guard",
                )
            order = trigger.order
            if (
                order is not None
                and order.entity is not None
                and order.entity.template != trigger.key.template
                and workflows[trigger.workflow].partitions > 1
            ):
                # An entity's mark sits in the slot of the claims that compare with it:
                # on a partitioned workflow, only a key that is the entity puts all of
                # an entity's events in one partition.
                raise ConfigError(
                    file,
                    f"order.key must be the trigger's key ({trigger.key.template}) on workflow "
                    f"'{trigger.workflow}', which has partitions: an entity's events must "
                    "be claimed in one partition",
                    section="trigger",
                    name=trigger.name,
                    field="order.key",
                )
            limit = trigger.rate_limit
            if (
                limit is not None
                and (limit.key is None or limit.key.template != trigger.key.template)
                and workflows[trigger.workflow].partitions > 1
            ):
                # A window sits in the slot of the claims that count in it: on a
                # partitioned workflow, only the trigger's key keeps them in one.
                raise ConfigError(
                    file,
                    f"rate_limit.key must be the trigger's key ({trigger.key.template}) on "
                    f"workflow '{trigger.workflow}', which has partitions: one window's "
                    "starts must be claimed in one partition",
                    section="trigger",
                    name=trigger.name,
                    field="rate_limit.key",
                )
            if trigger.path in RESERVED_PATHS or trigger.path.startswith(("/v1/", "/ui/")):
                raise ConfigError(
                    file,
                    f"{trigger.path} is the gateway's own route; pick another path "
                    "(reserved: /v1/…, /ui/…, " + ", ".join(sorted(RESERVED_PATHS)) + ")",
                    section="trigger",
                    name=trigger.name,
                    field="path",
                )
    if with_triggers:
        _check_ingress(settings.ingress, triggers, file)
    version = hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
    return Config(
        file=file, workflows=workflows, settings=settings, triggers=triggers, version=version
    )


def _check_ingress(
    ingress: Mapping[str, object], triggers: Mapping[str, Trigger], file: str
) -> None:
    """Each path of ``settings.ingress`` is one a trigger serves: a limit on a path
    nothing serves would never apply, most likely a typo that leaves the real path open."""
    served = sorted({trigger.path for trigger in triggers.values()})
    for path in ingress:
        if path not in served:
            known = ", ".join(served) or "none"
            raise ConfigError(
                file,
                f"no trigger serves {clip(path, 100)}{did_you_mean(path, served)}; "
                f"the triggers' paths: {clip(known)}",
                section="settings",
                field=f"ingress.{clip(path, 100)}",
            )


def _check_handlers(workflows: Mapping[str, Workflow], file: str, triggers: object) -> None:
    """Each workflow's ``handlers:``, parsed as ``realm work`` will build them: a
    command's ``env:`` may not list a variable the file names as a secret."""
    secrets = _secret_names(workflows, triggers)
    for name, workflow in workflows.items():
        if workflow.handlers is not None:
            parse_handlers(workflow.handlers, file=file, workflow=name,
                           steps=list(workflow.steps), secrets=secrets)  # fmt: skip


def _secret_names(workflows: Mapping[str, Workflow], triggers: object) -> frozenset[str]:
    """Every ``secret_env`` of the file: the triggers' (``verify.secret_env``, a name or
    a list) and the http handlers'. Read from the raw file, so that they count even
    when the triggers are not loaded (``realm work``); malformed entries are the
    triggers' parser's to refuse."""
    found: list[object] = []
    for trigger in triggers.values() if isinstance(triggers, dict) else ():
        verify = trigger.get("verify") if isinstance(trigger, dict) else None
        value = verify.get("secret_env") if isinstance(verify, dict) else None
        found += value if isinstance(value, list) else [value]
    for workflow in workflows.values():
        handlers = workflow.handlers if isinstance(workflow.handlers, dict) else {}
        for spec in handlers.values():
            found.append(spec.get("secret_env") if isinstance(spec, dict) else None)
    return frozenset(name for name in found if isinstance(name, str))


# --------------------------------------------------------------------------- YAML

# A triggers.yaml is a few hundred nodes; aliases may share a block (a `verify`
# used by several triggers) but not multiply it into millions (an alias bomb).
MAX_YAML_NODES = 100_000
MAX_YAML_DEPTH = 64


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing what a config must never mean silently:
    a key written twice (YAML keeps the last one, so a second `verify:` would
    replace the first), aliases that expand past MAX_YAML_NODES, recursive
    anchors and nesting past MAX_YAML_DEPTH. Each error carries its line."""

    def compose_document(self) -> yaml.Node:
        node = super().compose_document()
        _check_node_graph(node)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base`: its keys may be overridden, on purpose
            key = self.construct_object(key_node)
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: the base class says so
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {clip(repr(key), 60)} (first at line "
                    f"{first.start_mark.line + 1}); write each key once",
                    key_node.start_mark,
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def _check_node_graph(root: yaml.Node | None) -> None:
    """Refuse recursive anchors, alias bombs and deep nesting, in time linear in
    the number of distinct nodes (a shared node is sized once)."""
    if root is None:
        return
    size: dict[int, int] = {}  # id(node) → expanded node count, capped
    active: set[int] = set()  # nodes on the current path: meeting one is a cycle
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, done = stack.pop()
        children = _children(node)
        if done:
            active.discard(id(node))
            size[id(node)] = min(MAX_YAML_NODES + 1, 1 + sum(size[id(c)] for c in children))
            if size[id(node)] > MAX_YAML_NODES:
                _refuse(node, f"aliases expand to more than {MAX_YAML_NODES} values")
            continue
        if id(node) in size:
            continue
        if depth > MAX_YAML_DEPTH:
            _refuse(node, f"nested more than {MAX_YAML_DEPTH} levels deep")
        active.add(id(node))
        stack.append((node, depth, True))
        for child in children:
            if id(child) in active:
                _refuse(child, "an anchor is used inside itself (a recursive alias)")
            if id(child) not in size:
                stack.append((child, depth + 1, False))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _refuse(node: yaml.Node, problem: str) -> None:
    raise yaml.composer.ComposerError(None, None, problem, node.start_mark)


def load_yaml(text: str, file: str) -> object:
    """Parse YAML text with _StrictLoader; any problem is a one-line ConfigError."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: safe
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(file, f"not valid YAML{where}: {clip(problem)}") from None
    except RecursionError:
        raise ConfigError(
            file, f"not valid YAML: nested more than {MAX_YAML_DEPTH} levels deep"
        ) from None
    except ValueError as exc:  # e.g. `2024-13-45`, read as a date
        raise ConfigError(file, f"not valid YAML: {clip(str(exc))}") from None
