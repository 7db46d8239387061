"""Serving: the listener process. App composition, ``realm listen`` and its
workers, hot reload, the pid file and ``/metrics``."""
