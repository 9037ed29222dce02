"""Replay recorded runs through the planner of this checkout and score its step-time predictions.

A GPU host's end-to-end run (`tools/bench_link.py`, e.g. `tools/gpu_run.sh e2e`) keeps every adaptive step's
observation in its trace (`obs`: what the planner saw). Fed back here in the same order, with one planner per link
condition as in the run, they let a planner change be judged on any machine against the costs a real run measured:
before each tree step the planner prices the shape that step actually ran (`Planner._seconds`), and the report
compares that with the step's measured wall time, per RTT and shape.

What it cannot replay: the choices themselves (a different planner would have drafted other trees, whose costs the
run never measured), and the one draft decode the decoder times during the prompt's prefill (the replay calibrates
with the first tree's cost per decode instead). To compare two planner versions, run this file from each checkout.

    python tools/replay_planner.py docs/bench/gpu_e2e_<date>.json [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def replay(path: Path) -> tuple[list[dict], dict]:
    """Each adaptive tree step's (rtt, mbit, shape, predicted_s, wall_s) from one bench_link JSON, and the planners
    left at the end of each link condition (keyed "rtt/mbit")."""
    from edgespec.cli.bench import read_results
    from edgespec.edge.planner import Planner, StepObservation

    meta = read_results(path)["meta"]
    runs = [r for r in meta["runs"] if r["mode"] == "adaptive"]
    if not any("obs" in step for r in runs for step in r.get("trace", [])):
        raise SystemExit(f"{path}: no recorded observations (traces have `obs` from 2026-12-05, 30th session on)")
    steps, planners = [], {}
    for r in runs:   # in the order they ran: the condition's planner carried over from prompt to prompt
        key = f"{r['rtt_ms']:g}/{r['mbit']:g}"
        planner = planners.setdefault(key, Planner())
        planner.begin_request(meta["max_tokens"])
        for step in r["trace"]:
            obs = StepObservation.from_record(step["obs"])
            if obs.draft_decodes and not planner.draft_calibrated and not obs.prepared:
                planner.calibrate_draft(obs.draft_s / obs.draft_decodes)
            if obs.draft_decodes:
                rung = planner.rung_of(obs.shape)
                steps.append({"rtt_ms": r["rtt_ms"], "mbit": r["mbit"], "shape": obs.shape,
                              "predicted_s": planner._seconds(rung), "wall_s": obs.wall_s})
            planner.observe(obs)
    return steps, planners


def report(steps: list[dict]) -> dict:
    """Per (RTT, shape) and overall: steps, mean predicted and measured step time, mean relative error and its mean
    absolute value (a step's prediction is an expectation over drafted-ahead or not; single steps scatter)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for s in steps:
        groups[(s["rtt_ms"], s["mbit"], s["shape"])].append(s)
    rows = []
    for (rtt, mbit, shape), group in sorted(groups.items()):
        rel = [s["predicted_s"] / s["wall_s"] - 1 for s in group]
        rows.append({"rtt_ms": rtt, "mbit": mbit, "shape": shape, "steps": len(group),
                     "predicted_ms": 1000 * sum(s["predicted_s"] for s in group) / len(group),
                     "wall_ms": 1000 * sum(s["wall_s"] for s in group) / len(group),
                     "bias": sum(rel) / len(rel), "abs_error": sum(map(abs, rel)) / len(rel)})
    rel = [s["predicted_s"] / s["wall_s"] - 1 for s in steps]
    overall = {"steps": len(rel), "bias": sum(rel) / max(len(rel), 1), "abs_error": sum(map(abs, rel)) / max(len(rel), 1)}
    return {"rows": rows, "overall": overall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="bench_link JSON files (--json) with step traces")
    ap.add_argument("--json", type=Path, help="write the report here too")
    args = ap.parse_args(argv)
    steps = [s for path in args.runs for s in replay(path)[0]]
    result = report(steps)
    print("| RTT ms | Mbit/s | shape | steps | predicted ms | measured ms | bias | mean abs. error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['rtt_ms']:g} | {r['mbit']:g} | {r['shape']} | {r['steps']} | {r['predicted_ms']:.1f} | "
              f"{r['wall_ms']:.1f} | {r['bias']:+.2f} | {r['abs_error']:.2f} |")
    o = result["overall"]
    print(f"all {o['steps']} tree steps: bias {o['bias']:+.3f}, mean absolute error {o['abs_error']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
