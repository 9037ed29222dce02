"""The device side: drafting token trees, the session loop, and the link to a verifier."""
