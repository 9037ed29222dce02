"""Align the draft with the target from the verifier's step logs: train a LoRA adapter (peft)
minimising KL(target || draft) where the target decided, export it as a llama.cpp GGUF adapter,
and version it.

    .venv/bin/python tools/distill.py --logs LOG_DIR [LOG_DIR ...] --draft draft --out ADAPTERS_DIR \\
        [--eval-logs HELD_OUT_DIR ...] [--steps 200] [--rank 8] [--alpha 16] [--targets q_proj,v_proj] \\
        [--lr 1e-3] [--max-len 512] [--depth 4] [--parent current|none|VERSION] [--threads N]
    .venv/bin/python tools/distill.py --evaluate VERSION --eval-logs HELD_OUT_DIR --draft draft --out ADAPTERS_DIR

Data: `edgespec verifier serve --log-dir` (edgespec/verifier/steplog.py) records, per verified
step, the target's top-k log-probs at every position that decided a committed token. A
conversation's steps cover its answer contiguously (each step's rows run from its root to its
next token), so the steps are merged back into one sequence per conversation with the target's
distribution at every answer position. The loss at a position is the KL divergence from the
target's distribution over its top-k tokens plus one "rest" bucket (whose mass the log knows) to
the draft's distribution over the same buckets: exact for the part of the vocabulary that matters,
a lower bound of the full KL.

Draft: the GGUF draft read into HF transformers (which de-quantises it through the `gguf`
package; llama and qwen2 architectures). Needs the `distill` extra (torch, transformers, peft).

Held-out measure: `tau_chain` is the mean tokens per target step of greedy chain speculation with
`--depth` drafts, replayed on held-out conversations: along the target's own answer, the draft
(teacher-forced, so its chain is exactly what it would draft while it agrees) proposes its argmax
until it first disagrees with the target; the step commits the agreeing drafts plus the target's
token. It is computed with the HF float model, so llama.cpp's quantised draft may differ slightly.
Without --eval-logs, conversations are split by a hash of their prompt (--holdout fraction).

Output (ADAPTERS_DIR): `vNNNN.gguf` (the llama.cpp adapter: general.type=adapter,
adapter.type=lora, adapter.lora.alpha, `blk.N.<tensor>.weight.lora_a/lora_b`), `vNNNN.safetensors`
(the peft weights, to continue training from), and `manifest.json`: per version its parent, base
model, training-data hash, settings and held-out KL/top-1/τ before and after; `current` names the
newest. The edge keeps the previous adapter and rolls back on measured acceptance
(edgespec/edge/adapter_rollback.py).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgespec.common import modelstore  # noqa: E402
from edgespec.verifier.steplog import read_meta, read_steps  # noqa: E402

MANIFEST = "manifest.json"
# HF module name -> llama.cpp tensor name inside block N
HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


# --------------------------------------------------------------------------- data
@dataclass
class Example:
    """One conversation: tokens, and at `positions` the target's distribution of the next token."""

    tokens: np.ndarray          # int64
    positions: np.ndarray       # int64: the row at positions[i] predicts tokens[positions[i] + 1]
    topk_ids: np.ndarray        # int64 (n, k)
    topk_logprobs: np.ndarray   # float32 (n, k)

    @property
    def prompt_key(self) -> bytes:
        return self.tokens[: int(self.positions[0]) + 1].tobytes()


def load_examples(log_dirs: Iterable[str | os.PathLike]) -> list[Example]:
    """Merge each session's logged steps into conversations (a step that does not continue the
    previous one's commit starts a new conversation)."""
    examples: list[Example] = []
    for log_dir in log_dirs:
        current: dict[str, tuple[list[int], list[int], list[np.ndarray], list[np.ndarray]]] = {}

        def close(session: str) -> None:
            tokens, positions, ids, lps = current.pop(session)
            examples.append(Example(np.array(tokens, np.int64), np.array(positions, np.int64),
                                    np.concatenate(ids).astype(np.int64), np.concatenate(lps)))

        for step in read_steps(log_dir):
            context = step.context.tolist()
            held = current.get(step.session)
            if held is not None and context[: len(held[0])] != held[0]:
                close(step.session)
                held = None
            committed = [*context, *step.path.tolist(), step.next_token]
            if held is None:
                held = current[step.session] = ([], [], [], [])
            held[0][:] = committed
            held[1].extend(range(len(context) - 1, len(context) + step.path.size))
            held[2].append(step.topk_ids)
            held[3].append(step.topk_logprobs)
        for session in list(current):
            close(session)
    return examples


def data_hash(examples: Sequence[Example]) -> str:
    digest = hashlib.sha256()
    for ex in examples:
        for array in (ex.tokens, ex.positions, ex.topk_ids, ex.topk_logprobs):
            digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def split(examples: Sequence[Example], holdout: float) -> tuple[list[Example], list[Example]]:
    """Deterministic split by prompt: a prompt's conversations all land on the same side."""
    train, held = [], []
    for ex in examples:
        bucket = int.from_bytes(hashlib.sha256(ex.prompt_key).digest()[:4], "little") / 2**32
        (held if bucket < holdout else train).append(ex)
    return train, held


def windows(ex: Example, max_len: int) -> Iterable[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """(input ids, positions within them, top-k ids, top-k logprobs) over windows of at most
    max_len tokens; each window keeps as much left context as fits before its rows."""
    n = len(ex.positions)
    start_row = 0
    while start_row < n:
        first = int(ex.positions[start_row])
        end_row = start_row
        while end_row < n and int(ex.positions[end_row]) - first < max_len // 2:
            end_row += 1
        last = int(ex.positions[end_row - 1])
        lo = max(0, last + 1 - max_len)
        sel = slice(start_row, end_row)
        yield (ex.tokens[lo:last + 1], ex.positions[sel] - lo, ex.topk_ids[sel], ex.topk_logprobs[sel])
        start_row = end_row


# --------------------------------------------------------------------------- model
def load_draft(path: Path, threads: int | None = None):  # -> transformers PreTrainedModel
    """The GGUF draft as an HF model in float32 (transformers de-quantises it with `gguf`)."""
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    return model


def gguf_architecture(path: Path) -> str:
    import gguf

    field = gguf.GGUFReader(str(path)).fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def kl_buckets(draft_logits, topk_ids, topk_logprobs):  # torch tensors -> (per-row KL)
    """KL(p || q) over the target's top-k tokens plus a 'rest' bucket."""
    import torch

    log_q_all = torch.log_softmax(draft_logits.float(), dim=-1)
    log_q = log_q_all.gather(-1, topk_ids)
    log_p = topk_logprobs
    p = log_p.exp()
    p_rest = (1 - p.sum(-1)).clamp_min(1e-8)
    q_rest = (1 - log_q.exp().sum(-1)).clamp_min(1e-8)
    return (p * (log_p - log_q)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())


def draft_logits(model, ids: np.ndarray, positions: np.ndarray):  # -> torch tensor (len(positions), vocab)
    """The draft's logits at `positions` only: the output layer (vocabulary x hidden, the largest
    matrix of a small draft) runs on the decided rows, not on every token of the window."""
    import torch

    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = causal_lm.model(input_ids=torch.from_numpy(ids)[None]).last_hidden_state[0]
    return causal_lm.lm_head(hidden[torch.from_numpy(positions)])


def evaluate(model, examples: Sequence[Example], depth: int, max_len: int) -> dict:
    """Held-out KL, top-1 agreement and replayed greedy chain τ (module docstring)."""
    import torch

    kls, agree, steps, committed = [], [], 0, 0
    with torch.no_grad():
        for ex in examples:
            matches: list[bool] = []
            for ids, pos, tk_ids, tk_lps in windows(ex, max_len):
                logits = draft_logits(model, ids, pos)
                kls.append(kl_buckets(logits, torch.from_numpy(tk_ids), torch.from_numpy(tk_lps)).numpy())
                matches.extend((logits.argmax(-1).numpy() == tk_ids[:, 0]).tolist())
            agree.extend(matches)
            i = 0
            while i < len(matches):   # one target step: drafts agree until the first miss, then the target's token
                run = 0
                while run < depth and i + run < len(matches) and matches[i + run]:
                    run += 1
                commit = min(run + 1, len(matches) - i)
                steps, committed, i = steps + 1, committed + commit, i + commit
    return {"kl": float(np.mean(np.concatenate(kls))) if kls else float("nan"),
            "top1": float(np.mean(agree)) if agree else float("nan"),
            "tau_chain": committed / steps if steps else float("nan"), "depth": depth,
            "positions": len(agree), "conversations": len(examples)}


def train(model, examples: Sequence[Example], *, steps: int, lr: float, max_len: int, seed: int,
          log_every: int = 10) -> list[float]:
    """AdamW on the LoRA weights, one window per step (windows drawn at random)."""
    import torch

    batches = [w for ex in examples for w in windows(ex, max_len)]
    if not batches:
        raise SystemExit("no training positions in the logs")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    model.train()
    losses = []
    for step in range(steps):
        ids, pos, tk_ids, tk_lps = batches[int(rng.integers(len(batches)))]
        logits = draft_logits(model, ids, pos)
        loss = kl_buckets(logits, torch.from_numpy(tk_ids), torch.from_numpy(tk_lps)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if log_every and (step + 1) % log_every == 0:
            print(f"step {step + 1}/{steps}: KL {np.mean(losses[-log_every:]):.4f}", file=sys.stderr, flush=True)
    model.eval()
    return losses


def add_lora(model, rank: int, alpha: float, targets: Sequence[str]):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none")
    return get_peft_model(model, config)


# --------------------------------------------------------------------------- export
def _permute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order for llama-arch models (convert_hf_to_gguf's permute): the HF
    (rotate-half) layout -> GGUF's interleaved rope pairs."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def lora_tensors(peft_model, arch: str) -> dict[str, np.ndarray]:
    """GGUF adapter tensors (float32) from a peft model: A (r, in), B (out, r), per module."""
    from peft.tuners.lora import LoraLayer

    config = peft_model.base_model.model.config
    out: dict[str, np.ndarray] = {}
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer) or "default" not in module.lora_A:
            continue
        parts = name.split(".")
        block = int(parts[parts.index("layers") + 1])
        key = ".".join(parts[parts.index("layers") + 2:])
        if key not in HF_TO_GGUF:
            raise ValueError(f"no llama.cpp name for LoRA module {name}")
        a = module.lora_A["default"].weight.detach().float().numpy()
        b = module.lora_B["default"].weight.detach().float().numpy()
        if arch == "llama" and key == "self_attn.q_proj":
            b = _permute_rows(b, config.num_attention_heads)
        elif arch == "llama" and key == "self_attn.k_proj":
            b = _permute_rows(b, config.num_key_value_heads)
        base = f"blk.{block}.{HF_TO_GGUF[key]}.weight"
        out[f"{base}.lora_a"], out[f"{base}.lora_b"] = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return out


def write_gguf_adapter(path: Path, arch: str, alpha: float, tensors: dict[str, np.ndarray]) -> None:
    """llama.cpp's LoRA adapter format (what convert_lora_to_gguf.py writes), atomically."""
    import gguf

    tmp = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    for name, array in tensors.items():
        writer.add_tensor(name, array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)


# --------------------------------------------------------------------------- versions
def read_manifest(out_dir: Path) -> dict:
    path = out_dir / MANIFEST
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {"adapters": [], "current": None}


def write_manifest(out_dir: Path, manifest: dict) -> None:
    tmp = out_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    os.replace(tmp, out_dir / MANIFEST)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def run(args: argparse.Namespace) -> dict:
    """Train, export and register one adapter version; returns its manifest entry."""
    import torch
    from safetensors.torch import load_file, save_file

    torch.manual_seed(args.seed)
    draft = modelstore.resolve(args.draft, fetch_missing=False, progress=False) \
        if not Path(args.draft).is_file() else Path(args.draft)
    meta = read_meta(args.logs[0])
    examples = load_examples(args.logs)
    if args.eval_logs:
        train_set, held = examples, load_examples(args.eval_logs)
    else:
        train_set, held = split(examples, args.holdout)
    if not train_set:
        raise SystemExit(f"no training conversations in {args.logs}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(out_dir)
    versions = {a["version"]: a for a in manifest["adapters"]}
    parent = manifest.get("current") if args.parent == "current" else (None if args.parent == "none" else int(args.parent))
    if parent is not None and parent not in versions:
        raise SystemExit(f"parent version {parent} is not in {out_dir / MANIFEST}")

    arch = gguf_architecture(draft)
    model = add_lora(load_draft(draft, args.threads), args.rank, args.alpha, args.targets.split(","))
    if parent is not None:   # continue from the parent's weights (same rank and targets)
        model.load_state_dict(load_file(str(out_dir / versions[parent]["weights"])), strict=False)
    started = time.time()
    before = evaluate(model, held, args.depth, args.max_len) if held else None
    losses = train(model, train_set, steps=args.steps, lr=args.lr, max_len=args.max_len, seed=args.seed)
    after = evaluate(model, held, args.depth, args.max_len) if held else None

    version = max(versions, default=0) + 1
    gguf_path, weights_path = out_dir / f"v{version:04d}.gguf", out_dir / f"v{version:04d}.safetensors"
    write_gguf_adapter(gguf_path, arch, args.alpha, lora_tensors(model, arch))
    lora_state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if "lora_" in k}
    save_file(lora_state, str(weights_path))
    entry = {
        "version": version, "parent": parent, "file": gguf_path.name, "weights": weights_path.name,
        "sha256": file_sha256(gguf_path), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "base": {"file": draft.name, "architecture": arch, "sha256": file_sha256(draft)},
        "target": {k: meta.get(k) for k in ("model_id", "tokenizer_hash", "vocab_size")},
        "data": {"hash": data_hash(train_set), "conversations": len(train_set),
                 "positions": int(sum(len(e.positions) for e in train_set)), "logs": [str(p) for p in args.logs]},
        "train": {"steps": args.steps, "lr": args.lr, "rank": args.rank, "alpha": args.alpha,
                  "targets": args.targets.split(","), "max_len": args.max_len, "seed": args.seed,
                  "first_kl": losses[0], "last_kl": float(np.mean(losses[-10:])),
                  "seconds": round(time.time() - started, 1)},
        "heldout": {"before": before, "after": after,
                    "source": "eval-logs" if args.eval_logs else f"hash split {args.holdout}"},
    }
    manifest["adapters"].append(entry)
    manifest["current"] = version
    write_manifest(out_dir, manifest)
    return entry


def reevaluate(args: argparse.Namespace) -> dict:
    """Measure an existing version on (new) held-out logs, the base draft alongside, and record
    it in the manifest (`heldout`), e.g. once logs of prompts it never saw exist."""
    from safetensors.torch import load_file

    out_dir = Path(args.out)
    manifest = read_manifest(out_dir)
    entry = next((a for a in manifest["adapters"] if a["version"] == args.evaluate), None)
    if entry is None:
        raise SystemExit(f"version {args.evaluate} is not in {out_dir / MANIFEST}")
    held = load_examples(args.eval_logs)
    if not held:
        raise SystemExit("--evaluate needs --eval-logs with at least one conversation")
    draft = modelstore.resolve(args.draft, fetch_missing=False, progress=False) \
        if not Path(args.draft).is_file() else Path(args.draft)
    train_cfg = entry["train"]
    model = add_lora(load_draft(draft, args.threads), train_cfg["rank"], train_cfg["alpha"], train_cfg["targets"])
    model.load_state_dict(load_file(str(out_dir / entry["weights"])), strict=False)
    with model.disable_adapter():
        before = evaluate(model, held, args.depth, args.max_len)
    after = evaluate(model, held, args.depth, args.max_len)
    entry["heldout"] = {"before": before, "after": after, "source": "eval-logs",
                        "logs": [str(p) for p in args.eval_logs], "data_hash": data_hash(held)}
    write_manifest(out_dir, manifest)
    return entry


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--logs", nargs="+", default=[], help="step-log directories (verifier serve --log-dir)")
    ap.add_argument("--evaluate", type=int, default=None, metavar="VERSION",
                    help="no training: measure this version (and the base) on --eval-logs, record it in the manifest")
    ap.add_argument("--eval-logs", nargs="*", default=[], help="held-out step logs (default: split --logs)")
    ap.add_argument("--holdout", type=float, default=0.2, help="held-out fraction when there are no --eval-logs")
    ap.add_argument("--draft", default="draft", help="draft GGUF: manifest name, role alias or path")
    ap.add_argument("--out", required=True, help="adapter directory (versions + manifest.json)")
    ap.add_argument("--parent", default="current", help="'current' (default), 'none' or a version to start from")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--targets", default="q_proj,v_proj", help="HF module names to adapt (comma-separated)")
    ap.add_argument("--max-len", type=int, default=512, help="tokens per training window")
    ap.add_argument("--depth", type=int, default=4, help="chain depth of the held-out τ replay")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.evaluate is None and not args.logs:
        raise SystemExit("--logs is required (or --evaluate VERSION --eval-logs DIR)")
    entry = reevaluate(args) if args.evaluate is not None else run(args)
    print(json.dumps({k: entry[k] for k in ("version", "parent", "file", "heldout", "train")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
