"""The run store: key names, the Lua scripts, run starts and batches, steps and
leases, cancels, listing and paging, the sweep and reconcile."""
