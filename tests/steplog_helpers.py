"""Helpers (not tests): record a real verifier's step log by decoding prompts through it."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from grpc_helpers import ServerProcess

from edgespec import EdgeSession, TreeShape


def record_steps(target: str | os.PathLike, draft: str | os.PathLike, log_dir: Path, prompts: Sequence[str],
                 max_tokens: int = 24, tree: TreeShape = TreeShape(budget=8, max_depth=4, branching=2, width=2),
                 n_ctx: int = 1024) -> list[str]:
    """Answer each prompt (greedy) with `draft` through `edgespec verifier serve --log-dir log_dir`
    serving `target`; the server is stopped cleanly (SIGTERM) so the log is flushed. Returns the answers."""
    srv = ServerProcess(target, "--n-ctx", str(n_ctx), "--log-dir", str(log_dir), "--log-top-k", "16")
    answers = []
    try:
        with EdgeSession(draft, target, verifier=srv.address, n_ctx=n_ctx, tree=tree, fallback=False) as session:
            for prompt in prompts:
                answers.append(session.chat(prompt, max_tokens=max_tokens))
    finally:
        rc = srv.stop()
    assert rc == 0, "".join(srv.stderr)
    return answers
