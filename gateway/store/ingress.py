"""The per-path ingress limit's counter in Redis (``settings.ingress``): one script call
(gateway/store/lua/ingress.lua, GCRA) on one key per path, asked before a delivery is
read, so gateway processes sharing the Redis share the limit.

The key is ``<prefix>:ingress:{<path>}``: the path is the key's hash tag, so each
limited path may live on its own cluster primary and the script names one key. A
trigger's path can hold no brace (gateway/ingest/triggers.py refuses them), so the tag
is the whole path and two paths never share a key.
"""

from __future__ import annotations

from gateway.model.config import IngressLimit
from gateway.store.base import StoreBase


def ingress_key(prefix: str, path: str) -> str:
    """String: the path's theoretical arrival time (server time, µs)."""
    return f"{prefix}:ingress:{{{path}}}"


async def ingress_wait_us(store: StoreBase, path: str, limit: IngressLimit) -> int:
    """0 if one more delivery to ``path`` fits ``limit`` now (and it is counted); else
    the microseconds until one would. The caller bounds the call (it fails open).

    With the store's retries (``call_script``): a call whose reply was lost and is
    sent again counts the delivery twice, which errs on the side of the limit."""
    reply = await store.call_script(
        store.scripts.ingress, [ingress_key(store.prefix, path)], [limit.interval_us, limit.burst]
    )
    return int(reply)
