"""The faces programs use: the HTTP admin API (and its OpenAPI document), the MCP
tools and the ``/ui`` inspector."""
