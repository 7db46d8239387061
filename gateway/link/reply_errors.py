"""Redis error replies as redis-py's public exception classes, for the listener's own
pipelined connection (gateway/link/pipeline.py), which parses replies with hiredis.

The store and the cluster router catch these classes (a lost script cache, a replica,
a full server, a moved slot): the table names each error code they act on. Any other
error reply is a plain ``ResponseError`` holding the whole text, code included, as
redis-py gives it, so the store's "not now" prefixes (BUSY, MISCONF, NOREPLICAS...)
read it the same way. This replaces redis-py's private ``BaseParser.parse_error``.
"""

from __future__ import annotations

from redis import exceptions as redis_errors

# Error code -> class; the class gets the text after the code, as redis-py does (a
# MovedError or AskError parses "<slot> <host>:<port>" from it).
ERROR_CLASSES: dict[str, type[redis_errors.ResponseError]] = {
    "NOSCRIPT": redis_errors.NoScriptError,
    "OOM": redis_errors.OutOfMemoryError,
    "READONLY": redis_errors.ReadOnlyError,
    "MASTERDOWN": redis_errors.MasterDownError,
    "MOVED": redis_errors.MovedError,
    "ASK": redis_errors.AskError,
    "TRYAGAIN": redis_errors.TryAgainError,
    "CLUSTERDOWN": redis_errors.ClusterDownError,
    "CROSSSLOT": redis_errors.ClusterCrossSlotError,
    "NOPERM": redis_errors.NoPermissionError,
    "EXECABORT": redis_errors.ExecAbortError,
}
# Codes whose class is no ResponseError in redis-py: a server still loading its data
# is a connection-level "not now", and a refused login an authentication error.
OTHER_CLASSES: dict[str, type[redis_errors.RedisError]] = {
    "LOADING": redis_errors.BusyLoadingError,
    "WRONGPASS": redis_errors.AuthenticationError,
    "NOAUTH": redis_errors.AuthenticationError,
}
# Old servers say these with the generic ERR code.
ERR_CLASSES: dict[str, type[redis_errors.RedisError]] = {
    "invalid password": redis_errors.AuthenticationError,
    "max number of clients reached": redis_errors.ConnectionError,
}


def error_of(reply: str) -> redis_errors.RedisError:
    """The exception for one error reply's text (without the leading '-')."""
    code, _, rest = reply.partition(" ")
    if code in ERROR_CLASSES:
        return ERROR_CLASSES[code](rest)
    if code in OTHER_CLASSES:
        return OTHER_CLASSES[code](rest)
    if code == "ERR" and rest in ERR_CLASSES:
        return ERR_CLASSES[rest](rest)
    return redis_errors.ResponseError(reply)
