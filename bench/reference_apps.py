"""The two reference apps `bench/listen_bench.py` measures next to `realm listen`.

Both are module-level factories for ``uvicorn --factory`` and serve the same
route as the bench trigger, ``POST /hooks/github``:

* ``ceiling_app``: reads the body and answers 202. No parsing, no Redis: what
  Starlette on uvicorn (uvloop, httptools) can do on this machine at all.
* ``obvious_app``: what a first, straightforward webhook receiver would do:
  parse the body with the standard ``json`` module, take the delivery id from
  ``X-GitHub-Delivery`` and make one redis-py asyncio ``EVALSHA`` (via
  ``register_script``) of a minimal claim script (GET, SET, HSET, XADD), with
  the client's default settings. It does not verify the signature (an HMAC of
  3 KB is a few microseconds), match triggers or validate params.

The obvious app reads its Redis URL from ``BENCH_REDIS_URL``.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from redis.asyncio import Redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

PATH = "/hooks/github"

# KEYS[1] claim key, KEYS[2] run hash, KEYS[3] stream;
# ARGV[1] new run id, ARGV[2] repo, ARGV[3] sha.
# Reply: {1, run_id} when created, {0, existing run_id} when deduplicated.
CLAIM_LUA = """\
local existing = redis.call('GET', KEYS[1])
if existing then return {0, existing} end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], 'id', ARGV[1], 'phase', 'running', 'step', 'fetch',
  'repo', ARGV[2], 'sha', ARGV[3])
redis.call('XADD', KEYS[3], '*', 'run_id', ARGV[1], 'step', 'fetch')
return {1, ARGV[1]}
"""

_OK = b'{"status":"ok"}'


def ceiling_app() -> Starlette:
    async def hook(request: Request) -> Response:
        await request.body()
        return Response(_OK, 202, media_type="application/json")

    return Starlette(routes=[Route(PATH, hook, methods=["POST"])])


def obvious_app() -> Starlette:
    url = os.environ["BENCH_REDIS_URL"]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        client = Redis.from_url(url)  # default client settings
        try:
            yield {"claim": client.register_script(CLAIM_LUA)}
        finally:
            await client.aclose()

    async def hook(request: Request) -> Response:
        doc = json.loads(await request.body())
        delivery = request.headers["x-github-delivery"]
        run_id = str(uuid.uuid4())
        created, owner = await request.state.claim(
            keys=[f"obvious:key:{delivery}", f"obvious:run:{run_id}", "obvious:stream"],
            args=[run_id, doc["repository"]["full_name"], doc["after"]],
        )
        body = json.dumps({"status": "ok", "run_id": owner.decode(), "deduped": not created})
        return Response(body, 202 if created else 200, media_type="application/json")

    return Starlette(routes=[Route(PATH, hook, methods=["POST"])], lifespan=lifespan)
