"""Signature schemes: how each sender signs a webhook (GitHub, Stripe, Standard
Webhooks, Slack, ...), verified on the way in and used to sign the runners' requests."""
