"""The configuration model: frozen dataclasses for what ``triggers.yaml`` means, and
the errors every layer raises. It imports nothing else of the gateway."""

__version__ = "0.1.0"
