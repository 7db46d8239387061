"""The ``realm`` command line, one module per command group."""
