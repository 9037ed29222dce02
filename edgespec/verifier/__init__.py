"""The verifier service: the target model behind gRPC (`edgespec verifier serve`).

server.py (gRPC service, auth, TLS, health, reflection), sessions.py (session registry, LRU
eviction, the compute worker), backends.py (Backend interface), llama_backend.py (LlamaCppBackend),
factory.py (create_backend: a backend by name). The edge never imports this package: both sides meet in edgespec.common (wire.py) and on the wire.
"""
