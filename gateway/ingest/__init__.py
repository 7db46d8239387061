"""Ingest: from an HTTP request to claims. The edge, the webhooks ASGI app, the
request path (verify, match, extract, claim), triggers and the replies."""
