#!/usr/bin/env bash
# One staging call on the GPU host: append a carried GGUF piece to its file under $STAGE (tools/gpu_run.sh).
# Pieces are hard links with short names made by `tools/gpu_prepare.sh` (.stage/t00.. the target, .stage/d00..
# the draft), so a batch of ~32 staging calls is short to write: a lent machine idles back after 30 s, and the
# calls must follow the one before them at once. Piece 00 starts the file afresh. On a card other than $CARD
# (default H200; empty: any) the call does nothing, so a batch that landed on another card costs seconds.
#   run: carry [".stage/t03"]  command: bash tools/gpu_stage_piece.sh t03
set -euo pipefail
piece=${1:?usage: tools/gpu_stage_piece.sh tNN|dNN}
card=${CARD-H200}
if [ -n "$card" ] && ! nvidia-smi -L | grep -q "$card"; then echo "not an $card: skipped"; exit 0; fi
STAGE=${STAGE:-/tmp/stage}
source "$(dirname "$0")/gpu_models.sh"
case $piece in
  t*) file=$STAGE/$TARGET_GGUF ;;
  d*) file=$STAGE/$DRAFT_GGUF ;;
  *) echo "unknown piece $piece"; exit 2 ;;
esac
mkdir -p "$STAGE"
if [ "${piece:1}" = 00 ]; then rm -f "$file"; fi
cat ".stage/$piece" >> "$file"
ls -l "$file"
