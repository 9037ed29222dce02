"""Shared by the edge and the verifier: tree type, acceptance rules, RNG, errors, model store."""
