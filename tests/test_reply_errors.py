"""gateway/link/reply_errors.py: a real server's error replies, read by the listener's own
connection, become the redis-py classes the store catches (no private
import of redis-py's parser)."""

from __future__ import annotations

import pytest
import redis as redis_sync
from redis import exceptions as redis_errors

from gateway.link.pipeline import Pipeline
from gateway.link.reply_errors import error_of


def pipeline_to(port: int) -> Pipeline:
    return Pipeline({"host": "127.0.0.1", "port": port}, 5.0, 5.0)


async def reply_to(port: int, *command: bytes | str) -> object:
    pipeline = pipeline_to(port)
    try:
        return await pipeline.execute(*command)
    except redis_errors.RedisError as exc:
        return exc
    finally:
        pipeline.close()


async def test_a_lost_script_is_no_script_error(redis_server) -> None:
    reply = await reply_to(redis_server.port, b"EVALSHA", b"0" * 40, b"0")
    assert isinstance(reply, redis_errors.NoScriptError), reply


async def test_a_replica_refusing_a_write_is_read_only_error(start_redis) -> None:
    primary = start_redis()
    replica = start_redis("--replicaof", "127.0.0.1", str(primary.port))
    reply = await reply_to(replica.port, b"SET", b"k", b"v")
    assert isinstance(reply, redis_errors.ReadOnlyError), reply


async def test_a_full_server_is_out_of_memory_error(start_redis) -> None:
    server = start_redis("--maxmemory-policy", "noeviction")
    with redis_sync.Redis(port=server.port) as admin:
        admin.set("filler", "x" * (2 * 1024 * 1024))
        admin.config_set("maxmemory", "1mb")
    reply = await reply_to(server.port, b"SET", b"k", b"v")
    assert isinstance(reply, redis_errors.OutOfMemoryError), reply


async def test_any_other_error_is_a_response_error_with_its_whole_text(redis_server) -> None:
    reply = await reply_to(redis_server.port, b"NO-SUCH-COMMAND")
    assert type(reply) is redis_errors.ResponseError
    assert str(reply).startswith("ERR unknown command")


@pytest.mark.parametrize(
    ("text", "cls"),
    [
        ("MOVED 3999 127.0.0.1:6381", redis_errors.MovedError),
        ("ASK 3999 127.0.0.1:6381", redis_errors.AskError),
        ("TRYAGAIN Multiple keys request during rehashing of slot", redis_errors.TryAgainError),
        ("CLUSTERDOWN The cluster is down", redis_errors.ClusterDownError),
        ("LOADING Redis is loading the dataset in memory", redis_errors.BusyLoadingError),
        ("MASTERDOWN Link with MASTER is down", redis_errors.MasterDownError),
        ("WRONGPASS invalid username-password pair", redis_errors.AuthenticationError),
        ("BUSY Redis is busy running a script.", redis_errors.ResponseError),
    ],
)
def test_the_codes_the_store_acts_on(text: str, cls: type) -> None:
    error = error_of(text)
    assert type(error) is cls
    if isinstance(error, redis_errors.MovedError):
        assert (error.slot_id, error.host, error.port) == (3999, "127.0.0.1", 6381)
    if cls is redis_errors.ResponseError:
        assert str(error) == text  # the store reads its prefix
