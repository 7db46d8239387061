"""The two error families: coded run-start errors (the codes of docs/runs.md) and config errors."""

from __future__ import annotations


class RealmError(Exception):
    """A failure with a stable code, e.g. ``STATE_RUN_ALREADY_ACTIVE``.

    The message is written for the caller and never holds a secret.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class StoreUnavailable(RealmError):
    """Redis refused, timed out or dropped the connection: the outcome is unknown."""

    def __init__(self, message: str) -> None:
        super().__init__("STORE_UNAVAILABLE", message)


class Overloaded(StoreUnavailable):
    """This process has too many calls queued for a Redis connection: this one was not
    sent. Code ``OVERLOADED`` (503, retry in a second); a StoreUnavailable, so every
    caller that retries "not now" retries it too."""

    def __init__(self, message: str) -> None:
        RealmError.__init__(self, "OVERLOADED", message)


class ConfigError(Exception):
    """A bad ``triggers.yaml``: one line naming the file, the entry and the field."""

    def __init__(
        self,
        file: str,
        message: str,
        *,
        section: str | None = None,
        name: str | None = None,
        field: str | None = None,
    ) -> None:
        where = [file]
        if section and name is not None:
            where.append(f"{section} '{name}'")
        elif section:
            where.append(section)
        if field:
            where.append(f"field '{field}'")
        # One line, always: a name or value from the file may hold a line break.
        super().__init__(_one_line(": ".join([*where, message])))
        self.file = file
        self.section = section
        self.name = name
        self.field = field


def _one_line(text: str) -> str:
    if len(text.splitlines()) <= 1 and not text.endswith(("\n", "\r")):
        return text
    return "".join(
        ch.encode("unicode_escape").decode() if ch.splitlines() != [ch] else ch for ch in text
    )
