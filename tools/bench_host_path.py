"""Host time of Engine.verify with the step function stubbed: a batched step's Python, nothing else.

Engine._run is replaced by a precomputed decisions tensor of the bucket's shape (every tree accepts
the same chain of `--accept` nodes), so what is timed is verify's host work alone: the checks,
reserving blocks, packing the inputs, reading the decisions back, advancing and trimming the
sequences -- what tools/bench_gpu_verify.py's host_split calls `pack` + `rest` (on the H200 host
this Python ran 4-6x slower than on a 2-core CI box). tools/bench_verify_host.py times the
backend's verify_many around the real forward instead.

    .venv/bin/python tools/bench_host_path.py                          # B = 1, 8 x T = 1, 16, 64
    .venv/bin/python tools/bench_host_path.py --baseline HEAD~1        # A/B against a revision
    .venv/bin/python tools/bench_host_path.py --batch 8 --tree 64 --cprofile

Each cell keeps B sequences at --context tokens that grow by 1 + accept per step (put back to
--context between rounds, untimed); trees are numpy int64 arrays, as TorchBackend passes a wire
tree's. Times are CPU microseconds of the calling thread per step (time.thread_time_ns: steadier
than wall time on a shared box), medians over every timed step.

--baseline REV: the revision's edgespec package (git archive) and the working tree's each run in a
worker process of their own, and the rounds alternate between them (the first to run rotates), so
the box's drift over the run weighs on both alike.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import edgespec  # before bench_gpu_verify, which puts this checkout first on sys.path (--baseline's worker
                 # imports the revision's package from PYTHONPATH)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_verify import random_parents  # noqa: E402 - the GPU step benchmark's tree shapes


class Cells:
    """One engine per (B, T) cell, its sequences kept between calls (the edgespec on sys.path)."""

    def __init__(self, context: int, accept: int, block_size: int, steps_per_round: int) -> None:
        from edgespec.verifier.torch.model import ModelConfig, TransformerLM

        self.context, self.accept, self.block_size = context, accept, block_size
        self.grow = steps_per_round * (1 + accept)          # tokens a sequence gains in a round
        self.config = ModelConfig.tiny("qwen2")
        self.model = TransformerLM.random(self.config, max_positions=context + self.grow + 256)
        self.cells: dict[tuple[int, int], tuple] = {}

    def _cell(self, B: int, T: int) -> tuple:
        if (B, T) in self.cells:
            return self.cells[B, T]
        from edgespec.verifier.torch.engine import Engine, TreeStep, bucket

        per_seq = -(-(self.context + self.grow + T) // self.block_size) + 2
        engine = Engine(self.model, num_blocks=B * per_seq + 1, block_size=self.block_size, attention="torch",
                        compact_threshold=1.0)
        rng = np.random.default_rng(B * 1000 + T)
        seqs = []
        for _ in range(B):
            seq = engine.new_sequence()
            engine.prefill(seq, rng.integers(0, self.config.vocab_size, size=self.context).tolist())
            seqs.append(seq)
        k = min(self.accept, T - 1)
        steps = []
        for seq in seqs:
            parents = np.array(random_parents(T, rng), dtype=np.int64)
            parents[1:k + 1] = np.arange(k)              # nodes 1..k: the accepted chain
            tokens = rng.integers(0, self.config.vocab_size, size=T, dtype=np.int64)
            steps.append(TreeStep(seq, tokens, parents))
        Bb, Tb = bucket(B), bucket(T)
        out = torch.zeros(Bb, 2 + 2 * Tb)                # next token, k, path (root first), margins
        out[:, 0], out[:, 1] = 7, k
        out[:, 2:2 + k + 1] = torch.arange(k + 1, dtype=torch.float32)
        out[:, 2 + Tb:] = 0.5
        engine._run = lambda *_: out                     # the instance attribute hides the method
        self.cells[B, T] = cell = (engine, seqs, steps)
        return cell

    def time(self, B: int, T: int, n: int) -> list[float]:
        """n steps of the cell, microseconds each; the sequences are then put back to --context."""
        engine, seqs, steps = self._cell(B, T)
        times = []
        for _ in range(n):
            t = time.thread_time_ns()
            engine.verify(steps)
            times.append((time.thread_time_ns() - t) / 1e3)
        for seq in seqs:
            seq.truncate(self.context)
        return times


class Worker:
    """Cells in a process of its own, with `code` (a directory holding an edgespec package) first on
    its path; the same interface as Cells."""

    def __init__(self, code: Path, args: argparse.Namespace) -> None:
        env = {**os.environ, "PYTHONPATH": f"{code}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        cmd = [sys.executable, __file__, "--worker", "--context", str(args.context), "--accept", str(args.accept),
               "--block-size", str(args.block_size), "--steps", str(args.steps)]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.code = json.loads(self.proc.stdout.readline())["edgespec"]

    def time(self, B: int, T: int, n: int) -> list[float]:
        self.proc.stdin.write(f"{B} {T} {n}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def serve(args: argparse.Namespace) -> None:
    """--worker: answer "B T n" lines with a JSON list of n step times."""
    torch.set_num_threads(1)
    cells = Cells(args.context, args.accept, args.block_size, args.steps)
    print(json.dumps({"edgespec": edgespec.__file__}), flush=True)
    for line in sys.stdin:
        B, T, n = map(int, line.split())
        print(json.dumps(cells.time(B, T, n)), flush=True)


def profile(cells: Cells, B: int, T: int, n: int) -> None:
    import cProfile
    import pstats

    cells.time(B, T, n)                  # warm
    prof = cProfile.Profile()
    prof.enable()
    cells.time(B, T, n)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tree", type=int, nargs="+", default=[1, 16, 64], help="nodes per tree, root included")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--accept", type=int, default=3, help="drafted nodes every tree accepts")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=100, help="timed steps per cell and round")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--baseline", metavar="REV", help="A/B against this git revision's edgespec")
    ap.add_argument("--cprofile", action="store_true", help="profile the first cell in this process instead")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return serve(args)
    torch.set_num_threads(1)
    cells = list(itertools.product(args.batch, args.tree))
    if args.cprofile:
        return profile(Cells(args.context, args.accept, args.block_size, args.steps), *cells[0], args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        variants = {"current": REPO}
        if args.baseline:
            archive = subprocess.run(["git", "-C", str(REPO), "archive", args.baseline, "edgespec"],
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            variants = {args.baseline: Path(tmp), **variants}
        workers = {name: Worker(code, args) for name, code in variants.items()}
        times: dict[tuple, list[float]] = {(name, c): [] for name in workers for c in cells}
        names = list(workers)
        for r in range(args.rounds + 1):                     # round 0 warms up (untimed)
            for c in cells:
                for i in range(len(names)):
                    name = names[(r + i) % len(names)]
                    got = workers[name].time(*c, args.steps)
                    if r:
                        times[name, c] += got
        for w in workers.values():
            w.close()
    rows = []
    for c in cells:
        row = {"B": c[0], "T": c[1], **{f"{name}_us": round(statistics.median(times[name, c]), 1) for name in names}}
        if len(names) == 2:
            row["ratio"] = round(row[f"{names[1]}_us"] / row[f"{names[0]}_us"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"code": {name: str(w.code) for name, w in workers.items()}, "steps": args.steps,
                      "rounds": args.rounds, "context": args.context, "accept": args.accept}))


if __name__ == "__main__":
    main()
