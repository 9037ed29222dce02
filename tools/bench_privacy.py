"""PII masking figures for docs/BENCHMARKS.md: latency, recall/precision, end-to-end overhead.

    .venv/bin/python tools/bench_privacy.py [--latency-prompts 60] [--e2e] [--json out.json]

- latency: p50/p95 of `Masker.mask` per 200-word English prompt and per 300-character Chinese
  prompt (built from the labelled set's texts), with the spaCy model ("presidio") and with the
  pattern recognizers only ("patterns"); one thread (OMP/BLAS pinned to 1), after a warm-up; wall
  time and the calling thread's CPU time (what one free core would take on a loaded machine).
  Also per 40-word English message (a typical chat message), and per chat turn: `mask_messages`
  over a 6-turn history of ~40-word messages, turns 2-6 (the analyzer caches texts it has seen,
  so only the new message is analysed; --no-ner-cache measures the code before that cache).
- quality on tests/data/pii_labelled.jsonl (tools/pii_dataset.py): an entity is recalled when the
  masked spans cover all of its characters (type ignored: what matters is that the value does not
  leave); a masked span is a true positive when it overlaps a labelled entity. Every text gets a
  fresh vault, so values seen in earlier texts do not help.
- --e2e: tokens/s of EdgeSession.chat with the SmolLM2 test model as draft and target (local,
  greedy, planner-sized trees), masking off / patterns / presidio, wall time of the whole call;
  requests interleaved across the three sessions, and the masking time's share of the wall time.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from edgespec.edge.privacy import Masker, Vault  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "pii_labelled.jsonl"


def load() -> list[dict]:
    return [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]


def quality(masker: Masker, rows: list[dict]) -> dict:
    found, total = defaultdict(int), defaultdict(int)
    tp, fp = defaultdict(int), defaultdict(int)
    misses, false_pos = [], []
    for row in rows:
        masker.vault = Vault()
        text, lang = row["text"], row["lang"]
        spans = [s for s in masker.detect(text) if s.entity != "PLACEHOLDER_LIKE"]
        covered = np.zeros(len(text), bool)
        for s in spans:
            covered[s.start:s.end] = True
        for e in row["entities"]:
            for key in (lang, e["type"], "all"):
                total[key] += 1
            if covered[e["start"]:e["end"]].all():
                for key in (lang, e["type"], "all"):
                    found[key] += 1
            else:
                misses.append((e["type"], e["value"]))
        for s in spans:
            hit = any(s.start < e["end"] and e["start"] < s.end for e in row["entities"])
            for key in (lang, "all"):
                (tp if hit else fp)[key] += 1
            if not hit:
                false_pos.append((s.entity, text[s.start:s.end]))
    out = {}
    for key in sorted(total, key=lambda k: (k not in ("all", "en", "zh"), k)):
        entry = {"entities": total[key], "recall": round(found[key] / total[key], 3)}
        if key in tp or key in fp:
            entry["precision"] = round(tp[key] / max(1, tp[key] + fp[key]), 3)
            entry["masked_spans"] = tp[key] + fp[key]
        out[key] = entry
    out["missed"] = misses
    out["false_positives"] = false_pos
    return out


def prompts(rows: list[dict], lang: str, n: int, seed: int = 5, words: int = 200) -> list[str]:
    """n prompts of >= `words` words (English) or >= 1.5 x `words` characters (Chinese) from the set's texts."""
    rng = random.Random(seed)
    pool = [r["text"] for r in rows if r["lang"] == lang]
    out = []
    for _ in range(n):
        parts: list[str] = []
        while (len(" ".join(parts).split()) < words) if lang == "en" else (len("".join(parts)) < 1.5 * words):
            parts.append(rng.choice(pool))
        out.append((" " if lang == "en" else "").join(parts))
    return out


def latency(masker: Masker, texts: list[str], warm_up: list[str]) -> dict:
    for text in warm_up:   # texts of their own: the analyzer caches what it has seen
        masker.mask(text)
    times, cpu = [], []
    for text in texts:
        masker.vault = Vault()
        started, started_cpu = time.perf_counter(), time.thread_time()
        masker.mask(text)
        cpu.append((time.thread_time() - started_cpu) * 1000)
        times.append((time.perf_counter() - started) * 1000)
    # Wall time suffers from a loaded machine; the thread's CPU time is what one free core would take.
    return {"n": len(texts), "p50_ms": round(float(np.percentile(times, 50)), 2),
            "p95_ms": round(float(np.percentile(times, 95)), 2), "mean_ms": round(float(np.mean(times)), 2),
            "cpu_p50_ms": round(float(np.percentile(cpu, 50)), 2), "cpu_p95_ms": round(float(np.percentile(cpu, 95)), 2)}


E2E_PROMPTS = [
    "Write a short, polite e-mail to John Smith (john.smith@example.com) about the invoice.",
    "My phone is (415) 555-0132 and my card 4111 1111 1111 1111 was charged twice. What should I do?",
    "The server 192.168.10.24 rejects my key sk-proj-abcDEF1234567890ghijKLMN. How do I rotate it?",
    "我叫张伟，手机13912345678，帮我写一封请假邮件。",
    "Explain binary search in Python.",
]


def e2e(max_tokens: int, repeats: int) -> dict:
    """One session per mode, requests interleaved across modes (so load drift hits all alike)."""
    from contextlib import ExitStack

    from edgespec.common import modelstore
    from edgespec.edge.session import EdgeSession

    smol = modelstore.resolve("test", progress=False)
    modes = ("off", "patterns", "presidio")
    totals = {m: {"tokens": 0, "seconds": 0.0, "mask_s": 0.0} for m in modes}
    with ExitStack() as stack:
        sessions = {m: stack.enter_context(EdgeSession(smol, smol, local=True, n_ctx=2048,
                                                       privacy=None if m == "off" else m)) for m in modes}
        for session in sessions.values():
            session.chat("warm up", max_tokens=8)
        for _ in range(repeats):
            for prompt in E2E_PROMPTS:
                for mode, session in sessions.items():
                    before = session.stats.tokens
                    started = time.perf_counter()
                    session.chat(prompt, max_tokens=max_tokens)
                    totals[mode]["seconds"] += time.perf_counter() - started
                    totals[mode]["tokens"] += session.stats.tokens - before
                    if session.privacy is not None:
                        t0 = time.perf_counter()
                        session.privacy.mask(prompt)
                        totals[mode]["mask_s"] += time.perf_counter() - t0
    n = repeats * len(E2E_PROMPTS)
    return {m: {"tokens": t["tokens"], "seconds": round(t["seconds"], 2),
                "tokens_per_s": round(t["tokens"] / t["seconds"], 2),
                "mask_ms_per_request": round(1000 * t["mask_s"] / n, 2),
                "mask_share_of_wall": round(t["mask_s"] / t["seconds"], 4)} for m, t in totals.items()}


def chat_turns(masker: Masker, rows: list[dict], turns: int = 6, chats: int = 8) -> dict:
    """A chat re-sends its history every turn: the cost of `mask_messages` per turn from the
    second one on (user messages and assistant answers of ~40 words each, English)."""
    cpu = []
    for c in range(chats):
        user, answer = prompts(rows, "en", turns, seed=100 + c, words=40), prompts(rows, "en", turns, seed=200 + c, words=40)
        masker.vault = Vault()
        history: list[dict[str, str]] = []
        for t in range(turns):
            history.append({"role": "user", "content": user[t]})
            started = time.thread_time()
            masker.mask_messages(history)
            if t:
                cpu.append((time.thread_time() - started) * 1000)
            history.append({"role": "assistant", "content": answer[t]})
    return {"turns": len(cpu), "cpu_p50_ms": round(float(np.percentile(cpu, 50)), 2),
            "cpu_p95_ms": round(float(np.percentile(cpu, 95)), 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--latency-prompts", type=int, default=60)
    ap.add_argument("--e2e", action="store_true")
    ap.add_argument("--e2e-max-tokens", type=int, default=64)
    ap.add_argument("--e2e-repeats", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-ner-cache", action="store_true", help="analyse every text afresh (the code before the cache)")
    args = ap.parse_args()
    if args.no_ner_cache:
        from edgespec.edge.privacy.analyzer import PresidioNer
        PresidioNer.CACHED_TEXTS = 0
    rows = load()
    report: dict = {"dataset": {"texts": len(rows), "entities": sum(len(r["entities"]) for r in rows)},
                    "load_avg": os.getloadavg(), "cpus": os.cpu_count()}
    en, zh = prompts(rows, "en", args.latency_prompts), prompts(rows, "zh", args.latency_prompts)
    en40 = prompts(rows, "en", args.latency_prompts, seed=7, words=40)
    warm = prompts(rows, "en", 3, seed=9) + prompts(rows, "zh", 3, seed=9)
    for mode in ("patterns", "presidio"):
        started = time.perf_counter()
        masker = Masker(mode, strict=True)
        report[mode] = {"load_s": round(time.perf_counter() - started, 2),
                        "latency_en_200_words": latency(masker, en, warm),
                        "latency_zh_300_chars": latency(masker, zh, warm),
                        "latency_en_40_words": latency(masker, en40, warm),
                        "chat_turn_6x40_words": chat_turns(masker, rows),
                        "quality": quality(masker, rows)}
        q = report[mode]["quality"]
        print(f"{mode}: load {report[mode]['load_s']} s; en {report[mode]['latency_en_200_words']}; "
              f"zh {report[mode]['latency_zh_300_chars']}; en 40 words {report[mode]['latency_en_40_words']}; "
              f"chat turn {report[mode]['chat_turn_6x40_words']}", file=sys.stderr)
        print(json.dumps({k: v for k, v in q.items() if k not in ("missed", "false_positives")}), file=sys.stderr)
        print(f"  missed: {q['missed']}\n  false positives: {q['false_positives']}", file=sys.stderr)
    if args.e2e:
        report["e2e"] = e2e(args.e2e_max_tokens, args.e2e_repeats)
        print(json.dumps(report["e2e"]), file=sys.stderr)
    report["load_avg_after"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(report, ensure_ascii=False, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
