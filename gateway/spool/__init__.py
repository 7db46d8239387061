"""The spool: each worker's local, append-only files of verified deliveries that Redis
could not take in time, fsynced before the sender hears 202, and drained into Redis
through the request path once it answers (gateway/ingest/drain.py)."""
