"""Realm Gateway: verified webhook deliveries become exactly-once workflow runs."""

__version__ = "0.1.0"
