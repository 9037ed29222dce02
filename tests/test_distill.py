"""tools/distill.py end to end on SmolLM2 (CPU, a few steps): step logs from a real verifier run ->
LoRA training on KL(target || draft) -> GGUF adapter -> llama.cpp loads it, and its logits move
the way the trained HF model's do (which checks the exported layout, Q/K row permutation
included) -> a versioned adapter directory."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from steplog_helpers import record_steps

pytest.importorskip("peft")
pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import distill  # noqa: E402

PROMPTS = ["Name three colours.", "What is 2 + 2?", "Write a haiku about rain.", "List two fruits."]


def llama_logits(model, tokens: list[int], adapter=None) -> np.ndarray:
    from edgespec.runtime.llama import ContextConfig, TreeContext
    from edgespec.runtime.lora import set_adapters

    ctx = TreeContext(model, ContextConfig(n_ctx=256, n_threads=1, max_tree_nodes=8))
    try:
        set_adapters(ctx, [(adapter, 1.0)] if adapter is not None else [])
        return np.array(ctx.sync(tokens), dtype=np.float64)
    finally:
        ctx.close()


def test_distill_trains_exports_and_llama_cpp_applies_the_adapter(smol_path, smol_model, tmp_path) -> None:
    import torch

    from edgespec.runtime.lora import LoraAdapter

    logs = tmp_path / "logs"
    record_steps(smol_path, smol_path, logs, PROMPTS, max_tokens=24)
    examples = distill.load_examples([logs])
    assert len(examples) == len(PROMPTS)
    for ex in examples:   # every answer position carries the target's distribution, contiguously
        assert np.array_equal(ex.positions, np.arange(ex.positions[0], len(ex.tokens) - 1))
        assert np.array_equal(ex.topk_ids[:, 0], ex.tokens[ex.positions + 1])   # greedy: argmax committed

    out = tmp_path / "adapters"
    args = distill.parse_args(["--logs", str(logs), "--eval-logs", str(logs), "--draft", str(smol_path),
                               "--out", str(out), "--steps", "6", "--lr", "1e-2", "--rank", "4",
                               "--targets", "q_proj,k_proj,v_proj", "--threads", "1"])
    entry = distill.run(args)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["current"] == 1 and manifest["adapters"][0] == entry
    assert entry["parent"] is None and len(entry["data"]["hash"]) == 64
    assert entry["base"]["sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    for side in ("before", "after"):
        held = entry["heldout"][side]
        assert held["positions"] > 50 and 1.0 <= held["tau_chain"] <= 1 + held["depth"] and held["kl"] >= 0
    # Draft == target here: the base model already agrees with the log almost everywhere.
    assert entry["heldout"]["before"]["top1"] > 0.9

    # llama.cpp loads the adapter and its logits change the way the HF model's did.
    model = distill.add_lora(distill.load_draft(smol_path, threads=1), 4, 16.0, ["q_proj", "k_proj", "v_proj"])
    model.load_state_dict(__import__("safetensors.torch").torch.load_file(str(out / entry["weights"])), strict=False)
    tokens = smol_model.chat_tokens([{"role": "user", "content": "Tell me about the moon."}])
    with torch.no_grad():
        hf_tuned = model(torch.tensor([tokens])).logits[0, -1].double().numpy()
        with model.disable_adapter():
            hf_base = model(torch.tensor([tokens])).logits[0, -1].double().numpy()
    adapter = LoraAdapter(smol_model, out / entry["file"])
    try:
        base = llama_logits(smol_model, tokens)
        tuned = llama_logits(smol_model, tokens, adapter)
        again = llama_logits(smol_model, tokens)
    finally:
        adapter.close()
    assert np.array_equal(base, again)                       # switching back restores the base exactly
    llama_delta, hf_delta = tuned - base, hf_tuned - hf_base
    assert np.abs(llama_delta).max() > 0.05, np.abs(llama_delta).max()   # the adapter does something
    corr = float(np.corrcoef(llama_delta, hf_delta)[0, 1])
    assert corr > 0.9, corr                                    # ...and the same thing as in training

    # A second version continues from the first and records it as its parent.
    second = distill.run(distill.parse_args([*sys_args(args), "--steps", "2"]))
    assert second["version"] == 2 and second["parent"] == 1
    assert json.loads((out / "manifest.json").read_text())["current"] == 2


def sys_args(args) -> list[str]:
    return ["--logs", *map(str, args.logs), "--eval-logs", *map(str, args.eval_logs), "--draft", args.draft,
            "--out", args.out, "--lr", str(args.lr), "--rank", str(args.rank), "--targets", args.targets,
            "--threads", "1"]
