"""`edgespec serve`: the device daemon (OpenAI-compatible HTTP API, metrics, systemd notify).

app.py: routes and request validation; worker.py: the session pool and its queue; metrics.py:
Prometheus; notify.py: sd_notify; daemon.py: start-up order and shutdown.
"""
