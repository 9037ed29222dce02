"""EdgeSession with PII masking (local SmolLM2): the model only ever reads masked messages, streamed
and whole answers are restored alike, and token prompts are refused (they cannot be masked)."""
from __future__ import annotations

import pytest

from edgespec.common.sampling import SamplingParams
from edgespec.edge.drafting import TreeShape
from edgespec.edge.privacy import PrivacyError
from edgespec.edge.session import EdgeSession

HISTORY = [
    {"role": "system", "content": "You help Ms. Maria Garcia (maria.garcia@example.com) with her mail."},
    {"role": "user", "content": "Repeat exactly: call 13812345678 or write to maria.garcia@example.com."},
    {"role": "assistant", "content": "Sure: call 13812345678 or write to maria.garcia@example.com."},
    {"role": "tool", "content": "lookup result: key sk-abcdefghijklmnopqrstuvwxyz0123 on 10.1.2.3"},
    {"role": "user", "content": "Repeat exactly: call 13812345678 or write to maria.garcia@example.com."},
]
VALUES = ["Maria Garcia", "maria.garcia@example.com", "13812345678", "sk-abcdefghijklmnopqrstuvwxyz0123", "10.1.2.3"]


def test_session_masks_every_message_and_restores_streams(smol_path) -> None:
    with EdgeSession(smol_path, smol_path, local=True, n_ctx=2048, tree=TreeShape.chain(3), privacy="patterns",
                     draft_threads=1, target_threads=1) as session:
        seen: list[list[dict]] = []
        real_chat_tokens = session.draft_model.chat_tokens
        session.draft_model.chat_tokens = lambda messages: (seen.append(messages), real_chat_tokens(messages))[1]
        whole = session.chat(HISTORY, max_tokens=32)
        chunks = list(session.chat(HISTORY, max_tokens=32, stream=True))
        vault = session.privacy.vault
        with pytest.raises(PrivacyError):
            session.generate_tokens([1, 2, 3], 4, SamplingParams())
    assert len(seen) == 2 and all(m["role"] for m in seen[0])
    for messages in seen:   # every role, history and tool output included, reached the model masked
        text = "\n".join(m["content"] for m in messages)
        assert not any(v in text for v in VALUES) and "[EMAIL_1]" in text and "[PHONE_1]" in text
    assert len(vault) == 5
    assert "".join(chunks) == whole   # greedy: the same answer, streamed or not
    assert not any(p in whole for p in ("[EMAIL_1]", "[PHONE_1]", "[PERSON_1]"))
    assert "13812345678" in whole or "maria.garcia@example.com" in whole   # the model echoed placeholders
