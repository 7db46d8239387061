"""The run store: typed async wrappers over the Lua scripts, one ``RunStore`` per
config and Redis.

Its parts are modules of their own, each owning one concern, combined here into the
one class callers use:

- gateway/store/base.py: connections, scripts, the partitions' keys, a run by id,
  Redis calls under one deadline with retries;
- gateway/store/starts.py: run starts and batches (the policies on a repeated key);
- gateway/store/steps.py: runners taking, keeping and reporting steps under leases;
- gateway/store/endings.py: runs cancelled or failed before their last step;
- gateway/store/listing.py: runs listed a page at a time;
- gateway/store/checks.py: the layout, ping and script checks before serving.

Expected outcomes (a new run, a deduplicated one) are values; refusals by policy and
bad input raise ``RealmError`` with a stable code; Redis trouble raises
``StoreUnavailable`` (the caller answers 503 and the sender retries, which
deduplicates).
"""

from __future__ import annotations

from gateway.store.checks import StoreChecks
from gateway.store.endings import RunEndings
from gateway.store.listing import RunListing
from gateway.store.starts import RunStarts
from gateway.store.steps import RunSteps


class RunStore(RunStarts, RunSteps, RunEndings, RunListing, StoreChecks):
    """Run starts and run state for the workflows of one config, in one Redis."""
