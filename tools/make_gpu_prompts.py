#!/usr/bin/env python3
"""Tokenize the GPU benchmarks' chat prompts here, for tools/bench_gpu_real.py --prompts.

Why this exists: the GPU host runs the torch verifier on the target's weights alone; it has no
tokenizer (no llama.cpp model loaded there, no `tokenizers`). So the prompts travel as token ids,
made here with the target GGUF's own llama.cpp vocabulary and chat template, exactly the way the
product templates a one-message chat (`LlamaModel.chat_tokens`, as `EdgeSession.chat` does for a
prompt string). The output is a JSON list of token-id lists, one per prompt, in PROMPTS' order.

    .venv/bin/python tools/make_gpu_prompts.py                      # default target, tools/data/prompts_qwen.json
    .venv/bin/python tools/make_gpu_prompts.py --target path/to/target.gguf --out prompts.json

Prompts 0, 2, 3 and 5 are those of the earlier GPU runs (docs/BENCHMARKS.md, `bench_gpu_real`;
same token counts and the same first 12 greedy target tokens under llama.cpp); prompts 1 and 4
stand in for two whose text was lost with `.stage/` (same token counts, 43 and 41, other wording).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgespec.common import modelstore  # noqa: E402
from edgespec.runtime.llama import LlamaModel  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# Short coding and knowledge prompts (~40 tokens each once chat-templated).
PROMPTS: list[str] = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain how binary search works on a sorted array in three sentences.",
    "Write a Python class implementing a stack with push, pop and peek.",
    "What is the capital of France? Answer in one sentence.",
    "Write a short story about a robot who learns to paint.",
    "What is the difference between a process and a thread?",
]


def tokenize_prompts(target: str | Path, prompts: list[str]) -> list[list[int]]:
    """Each prompt as one user message, chat-templated and tokenized with `target`'s vocabulary."""
    model = LlamaModel(target, vocab_only=True)   # the tokenizer and chat template, no weights
    try:
        return [model.chat_tokens([{"role": "user", "content": text}]) for text in prompts]
    finally:
        model.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="target",
                    help="target model: manifest name, role alias or GGUF path (default: the manifest's target)")
    ap.add_argument("--out", type=Path, default=REPO / "tools" / "data" / "prompts_qwen.json")
    args = ap.parse_args()
    path = modelstore.resolve(args.target, fetch_missing=False)
    tokens = tokenize_prompts(path, PROMPTS)
    # One prompt per line: a small, readable diff when a prompt changes.
    args.out.write_text("[\n" + ",\n".join(json.dumps(t) for t in tokens) + "\n]\n")
    for i, (text, ids) in enumerate(zip(PROMPTS, tokens)):
        print(f"{i}: {len(ids)} tokens  {text}")
    print(f"wrote {len(tokens)} prompts ({path.name}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
