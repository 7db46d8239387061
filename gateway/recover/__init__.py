"""``realm recover``: deliveries that never reached the gateway, found through the
senders' own APIs and brought here.

A sender keeps a record of what it sent. GitHub lists each hook's deliveries and
redelivers one on request (it never does so by itself); Stripe lists the events whose
delivery failed. Each one is walked through the request path as a dry run
(gateway/ingest/delivery.py): a delivery whose claim would start a run never arrived,
and is redelivered (GitHub) or claimed here (Stripe). Everything else is already here,
or not for any trigger.

- gateway/recover/http.py: the client of a sender's API (pacing, rate limits, retries);
- gateway/recover/check.py: the dry run and what its reply means for a delivery;
- gateway/recover/github.py, gateway/recover/stripe.py: one sender each;
- gateway/recover/summary.py: what a run of the command found and did.
"""
