"""Generated gRPC stubs of proto/edgespec/v1/edgespec.proto (built by setup.py; not committed)."""
