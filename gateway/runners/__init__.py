"""Runners: take ready steps under a lease and run their handlers (commands, signed
HTTP calls, Python functions)."""
