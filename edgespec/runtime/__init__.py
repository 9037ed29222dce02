"""llama.cpp runtime: models, KV-cache contexts, and single-call tree decoding.

Used by the edge (drafter, local fallback target) and by the verifier's CPU backend.
"""
