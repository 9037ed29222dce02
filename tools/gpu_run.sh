#!/usr/bin/env bash
# The whole GPU-host run of issue 9 (verifier speed, checks, real weights, end to end) as one script.
# A lent GPU machine runs one command for at most 10 minutes and keeps /tmp only while it stays busy,
# so the script runs in phases, one device call each, back to back on the same machine:
#
#   tools/gpu_run.sh experiments   # random weights: kernel-knob variants against the defaults, checked,
#                                  #   then timed in the steps; the winners (tools/pick_knobs.py) are what
#                                  #   the later phases run with
#   tools/gpu_run.sh verifier      # random weights: ceilings, checks, attention vs cuDNN, steps vs HF,
#                                  #   prefill riding in verify steps, a kernel profile; gpt-fast beside it
#   tools/gpu_run.sh real          # real weights: greedy equality, capacity with recorded drafts, GPU χ²
#   tools/gpu_run.sh ncu           # random weights: Nsight Compute on the <= 64-row kernels (tools/ncu_kernels.py)
#   tools/gpu_run.sh e2e           # real weights: the edge (0.5B draft on the host CPU) against the GPU
#                                  #   verifier through the relay at RTT 0/20/50/100 ms; each greedy
#                                  #   divergence from AR recomputed in the GPU verifier's own steps
#
# Results go to $OUT (JSON, one file per tool). tools/gpu_prepare.sh makes what the calls carry: the wheels the GPU
# image lacks (.whl), gpt-fast's model and step script (.gptfast) and the GGUFs in pieces (.stage). Before `real`, stage
# the target GGUF under $STAGE, before `e2e` the draft too, one piece per call (tools/gpu_stage_piece.sh t00 .. t21,
# d00 .. d09, each call carrying its .stage/ piece); the generated protobuf stubs travel as
# `edgespec/v1` (see docs/BENCHMARKS.md for the exact calls);
# the tokenized prompts (tools/make_gpu_prompts.py) and the recorded drafts (bench_tau.py --humaneval 14
# --spec-bench-prompts 14 --max-tokens 128 --configs model+lookup --record-trees) are tracked in tools/data/.
# A lent machine that idles 30 s is given back (the thirty-fifth session lost an H200 while composing the staging
# calls after `verifier`), and calls batched behind one whose machine failed to start are each refused at a cost
# (thirty-sixth session): send the staging batch right after a call that got its machine; gpu_stage_piece.sh calls are
# short to write and skip themselves on a card other than an H200, and where only one card will do, begin the phases
# with `nvidia-smi -L | grep -q H200 || exit 0` too, so that on another card a batch costs seconds.
# The host's copy of the checkout may carry a stale git HEAD: pass the commit as CODE_REV=<sha> (bench_link
# records it).
set -uo pipefail
phase=${1:?usage: tools/gpu_run.sh experiments|verifier|real|capacity|e2e|ncu}
OUT=$(mkdir -p "${OUT:-gpu_out}" && cd "${OUT:-gpu_out}" && pwd)
STAGE=${STAGE:-/tmp/stage}
source "$(dirname "$0")/gpu_models.sh"
TARGET=$STAGE/$TARGET_GGUF
DRAFT=$STAGE/$DRAFT_GGUF
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:. EDGESPEC_CODE_REV=${CODE_REV:-}
ITERS=(--iters 30 --warmup 5)
# Kernel knobs (edgespec.verifier.torch.knobs) for every phase after `experiments`: the winners it wrote
# to $KNOBS_FILE on this machine, unless EDGESPEC_KERNEL_KNOBS is given (empty: the code's defaults)
KNOBS_FILE=/tmp/knobs.env
if [ -z "${EDGESPEC_KERNEL_KNOBS+set}" ] && [ -e "$KNOBS_FILE" ]; then source "$KNOBS_FILE"; fi
export EDGESPEC_KERNEL_KNOBS=${EDGESPEC_KERNEL_KNOBS:-}
echo "EDGESPEC_KERNEL_KNOBS=$EDGESPEC_KERNEL_KNOBS" | tee "$OUT/knobs_$phase.txt"

site() {  # the carried wheels, installed once per machine
  if [ ! -e /tmp/site/.done ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && touch /tmp/site/.done || exit 3
  fi
}

staged() {  # the GGUFs a phase reads must be complete: sha256 as in ~/.cache/edgespec/models here. `real` reads
            # the target alone (its drafts are recorded or synthetic), so staging the draft (10 more calls,
            # ~50 s of device time) is needed only for `e2e`
  sha256sum "$@" | tee "$OUT/sha256.txt"
  grep -q "^$TARGET_SHA256" "$OUT/sha256.txt" || { echo "staged target GGUF incomplete"; exit 4; }
  case " $* " in *" $DRAFT "*) grep -q "^$DRAFT_SHA256" "$OUT/sha256.txt" || { echo "staged draft GGUF incomplete"; exit 4; } ;; esac
}

case $phase in
  experiments)   # the defaults against each knob variant in one process; tools/pick_knobs.py names the winners
    # (earlier variants, TREE_SPLIT, GEMV_ROPE, MOVE_ROWS_KERNEL, TARGET_PROGRAMS, PDL, lost or were adopted:
    # docs/BENCHMARKS.md; the twelfth session's, timed round-robin: TARGET_PROGRAMS=192, SILU_BLOCK=4096,
    # NORM_WARPS=4 and the attention's registers capped at 128, none a gain beyond that run's 0.4 % noise.)
    # The thirteenth session's, round-robin: the small-rows matmul table, linear_silu from one row on (LINEAR_SILU_ROWS=1)
    # and RoPE in the wqkv matmul at 2-16 rows (ROWS_ROPE=1) adopted; GEMV_ROPE=1, MIN_SPLIT_KEYS=256,
    # SMALL_ROWS_AUTO=1 (with and without PDL=64) and TARGET_PROGRAMS=96 lost. The fourteenth session's: a later
    # PDL trigger (TRIGGER=1, 2; also with PDL=64, 512) lost in every cell (1 x 1 +8 to +10 %); 32-row attention
    # tiles where they pad less (M_TILE_FIT=1: T = 16) and wqkv at 17-64 rows on the balanced kernel with RoPE in its
    # epilogue (SMALL_ROWS_AUTO=1, whose only None entry left is that one) lost too. The fifteenth session's: wo and
    # the first lines of gate/up warmed into L2 by a side stream while attention runs (L2_WARM MB; L2_WARM_ROWS) won at
    # <= 16 rows in two calls and is the default (32 MB); at 1 x 64 every budget lost, 1024 rows a warming program lost.
    # The sixteenth session's: each query tile's last split program merging the splits (an arrival counter on the
    # device; no merge launch) was exact and repeatable but lost 9-28 % in every cell (its dependent per-split loads
    # run serially in one program) and was removed. The eighteenth session's (bench_gpu_verify sweeps, not this phase):
    # the attention's tiles and splits at the step's shapes (the defaults best or within 0.5 us a layer), argmax_top2's
    # chunks (2048 logits, 2 warps: adopted) and a gate/up GEMM with SiLU*up in its epilogue for many rows (slower
    # than cuBLAS + silu_mul: removed). The nineteenth session's: wqkv past 64 rows as a Triton GEMM with RoPE and the
    # cache writes in its epilogue (pointer loads 3x cuBLAS + rope_store at 512 rows, TMA tiles 1.1x; the 8 x 64 step
    # +3 to +4 %; warp specialization hung the process): removed. The twentieth session's: w2 on cuBLAS in K slices
    # (W2_SPLIT_K_ROWS=512: 8 x 16 -3.2 %, 8 x 32 -3.9 %) adopted; wo in slices, and budgets 1024 / 2048, lost or
    # tied; the small-rows matmuls with TMA tiles (tools/bench_tma_rows.py) no faster. The twenty-first session's:
    # PDL up to 64 rows (PDL=64: 1 x 64 -2.4 to -2.9 %) adopted; the batch's sequences in stream branches of the
    # step graph (+7 to +29 % wherever it split), PDL for the non-matmul kernels alone (PDL_SMALL: 8 x 64 +22 %) and
    # past 64 rows for the kernels behind our own (PDL_CHAINS: 8 x 64 +2.1 %) removed; deeper L2 prefetch before the
    # PDL wait (PREFETCH_TILES=4, 16) lost at <= 16 rows; L2 warming up to 64 rows (L2_WARM_ROWS=64) -0.9 % at
    # 1 x 64, once, not adopted. The twenty-second session's: RoPE and the step's K/V cache writes inside the
    # tree-attention kernel (ROPE_FROM_QKV; the split kernel or the merge writing) exact but 2-12 % slower, even
    # with no cache write at all: removed; the attention merge over 8 query rows a program from 512 token rows
    # (MERGE_ROWS, MERGE_ROWS_FROM: 8 x 64 -0.9 / -1.4 %) adopted; one persistent kernel with grid barriers lost to
    # PDL kernels (tools/bench_phase_overlap.py). The twenty-fourth session's (bench_gpu_verify variants with '%' matmul
    # table entries, not this phase): wqkv on linear_rows at 17-64 rows with RoPE in its epilogue (one PDL chain a layer),
    # L2 warming up to 64 rows and w2 with 8 stages adopted together (1 x 64 -7.9 %, 4 x 16 -7.3 %); PREFETCH_TILES=2
    # (0.2-1.0 %, noise), 32 attention splits (1 x 16 -1.2 %, 1 x 64 +6.8 %) and every neighbouring matmul config
    # within noise or slower. The twenty-sixth session's: the small-rows kernel past 64 rows
    # (--small-rows-matmul 128 with '%...r128=...' entries and LINEAR_ROWS_MAX=128; with or without PDL=128 and
    # L2_WARM_ROWS=128, or wqkv and wo alone) 3-9 % slower than cuBLAS at 128 rows (4 x 32, 8 x 16): not adopted. The
    # thirty-fifth session's: more warming beside the MLP (the next wqkv beside w2, w2 beside gate/up) and evict-last
    # warmed lines lost in every <= 64-row cell (+1 to +7 %, H100); wqkv with K split at 17-64 rows, RoPE summing the
    # partials (+0.6 to +1.6 %), and the attention skipping empty splits (up to +1.2 %) lost too: all removed. The
    # twenty-seventh session's knobs, the attention reading its lengths and block ids and asking L2 for context K/V
    # before its PDL wait (EARLY_INDEX, PREFETCH_KEYS), measured in the twenty-ninth: no gain, off. The thirty-sixth
    # session's: cuBLAS without a workspace (engine.CUBLAS_WORKSPACE; per process, so A/B'd in alternating processes:
    # 8 x 64 -2 %) adopted; WARM_BELOW_MAIN=1 (the chain captured above the warming's priority) built, not yet
    # measured: add 'triton!WARM_BELOW_MAIN=1' with --checks l2_warm. The thirty-seventh session's: the norms after wo
    # and w2 inside the matmuls around them (FUSED_NORMS, b9c24b9; H100: 1 x 64 +56 % / +111 %, the norm applied to
    # each x tile as gate/up or wqkv loads it broke their pipeline at 64 rows) lost and were removed. Otherwise the
    # phase times the defaults; add a variant as 'triton,triton!KNOB=V' (with the pdl check for PDL or TRIGGER,
    # l2_warm for L2_WARM).
    EDGESPEC_KERNEL_KNOBS= python3 tools/bench_gpu_verify.py --skip attention,capacity,mixed,hf,matmuls \
      --checks kernel,engine,l2_warm --trees 1,16,64 --attention 'triton' \
      "${ITERS[@]}" --out "$OUT/variants.json" \
      && python3 tools/pick_knobs.py "$OUT/variants.json" --env "$OUT/knobs.env" && cp "$OUT/knobs.env" "$KNOBS_FILE"
    ;;
  verifier)
    site
    python3 tools/bench_gpu_verify.py --skip matmuls,capacity --trees 1,16,64 --attention triton \
      --attention-configs '0x0w4s0,64x64w4s3,128x32w4s2' \
      --profile-cells 1x1,1x16,1x64,8x64 "${ITERS[@]}" --out "$OUT/verifier.json"
    if [ -d .gptfast ]; then (cd .gptfast && OUT="$OUT" python3 step4.py); fi
    ;;
  real)
    site; staged "$TARGET"
    python3 tools/bench_gpu_real.py --model "$TARGET" --prompts tools/data/prompts_qwen.json --tokens 96 --out "$OUT/real.json"
    bash "$0" capacity
    python3 tools/check_gpu_sampling.py --trials 65536 --batch 32 --out "$OUT/gpu_sampling.json"
    ;;
  capacity)   # (part of `real`; alone where only capacity is re-measured)
    site; staged "$TARGET"
    # recorded trees cut to 16, 32 and 64 nodes against one-token steps. Under load the planner's trees shrink (its
    # load factor prices nodes dearer); at 32 sessions 64-node trees make every step 1024 rows, GPU-bound
    # (fifteenth session: 2.04x AR with 64 only). A cut tree accepts fewer tokens, so a session stops between the
    # recorded steps: there the last recorded tree is re-rooted (RecordedTrees), not replaced by a root-only one
    python3 tools/bench_gpu_verify.py --skip ceilings,checks,attention,matmuls,step,hf,mixed,capacity --model "$TARGET" \
      --capacity-trace tools/data/rec_trees.jsonl --capacity-rejoin --capacity-sessions 1,8,32 --capacity-trees 1,16,32,64 \
      --capacity-s 3 --capacity-warmup-s 2 --out "$OUT/capacity.json"
    ;;
  e2e)
    site; staged "$TARGET" "$DRAFT"
    python3 tools/bench_link.py --local-link --rtts 0,20,50,100 --humaneval 2 --spec 1 --max-tokens 64 \
      --warmup-tokens 24 --budget-min 7 --modes ar,chain4,adaptive --draft "$DRAFT" --target "$TARGET" \
      --draft-threads 8 --verifier-args="--backend torch --device cuda" --plot "$OUT/e2e.png" --json "$OUT/e2e.json"
    # every greedy divergence from AR, recomputed in the GPU verifier's own steps (1-row and tree rows)
    python3 tools/explain_divergence.py "$OUT/e2e.json" --all --backend torch --device cuda --target "$TARGET" \
      --json "$OUT/e2e_divergences.json"
    # the planner's step-time predictions against the run's measured steps (the same replay runs anywhere later)
    python3 tools/replay_planner.py "$OUT/e2e.json" --json "$OUT/e2e_replay.json"
    ;;
  ncu)   # why the <= 64-row kernels take what they take: Nsight Compute (on the GPU host's PATH) on one launch each
    # of the small-rows matmuls at 16 and 64 rows and of the tree attention at T = 1 and 64 (tools/ncu_kernels.py).
    # ncu flushes L2 and holds the base clock: compare ratios, not durations (docs/BENCHMARKS.md, 34th session)
    site
    NCU=$(command -v ncu) || { echo "no ncu on this host"; exit 5; }
    S="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats"
    S="$S --section LaunchStats --section Occupancy"
    "$NCU" --profile-from-start off $S python3 tools/ncu_kernels.py matmuls 16,64 > "$OUT/ncu_matmuls.txt" 2>&1
    "$NCU" --profile-from-start off $S python3 tools/ncu_kernels.py attention 1,64 > "$OUT/ncu_attention.txt" 2>&1
    grep -hE "^  _|Duration|DRAM Throughput|L2 Cache Throughput|Eligible Warps|Achieved Occupancy" \
      "$OUT/ncu_matmuls.txt" "$OUT/ncu_attention.txt"
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
