#!/usr/bin/env bash
# One-shot, idempotent set-up: virtualenv in .venv, llama-cpp-python built with flags that run on
# this machine (wheel cached), edgespec with its extras, and the default models in the cache.
#   tools/setup.sh            # edge + verifier + router + distill + dev tools, default models + router embeddings
#   EDGESPEC_MODELS="test" tools/setup.sh   # only fetch the small test model
# Environment: EDGESPEC_HOME (cache, default ~/.cache/edgespec), EDGESPEC_LLAMA_FLAVOR
# (cpu-portable | cuda), PYTHON (interpreter for the venv).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
HOME_DIR=${EDGESPEC_HOME:-$HOME/.cache/edgespec}
PYTHON=${PYTHON:-python3}
VENV=${EDGESPEC_VENV:-$ROOT/.venv}
LLAMA_VERSION=0.3.36
FLAVOR=${EDGESPEC_LLAMA_FLAVOR:-cpu-portable}
MODELS=${EDGESPEC_MODELS:-default test router}

case "$FLAVOR" in
  # The default -march=native build dies with "Illegal instruction" on VMs that advertise AMX.
  cpu-portable) LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAVA_BUILD=OFF" ;;
  cuda) LLAMA_CMAKE_ARGS="-DGGML_CUDA=on -DLLAVA_BUILD=OFF ${EDGESPEC_CUDA_ARCH:+-DCMAKE_CUDA_ARCHITECTURES=$EDGESPEC_CUDA_ARCH}" ;;
  *) echo "unknown EDGESPEC_LLAMA_FLAVOR=$FLAVOR (cpu-portable|cuda)" >&2; exit 2 ;;
esac
if [ "$FLAVOR" = cpu-portable ] && [ "$(uname -m)" != x86_64 ]; then
  LLAMA_CMAKE_ARGS="-DLLAVA_BUILD=OFF"   # aarch64 (Jetson without CUDA): the native build is fine
fi

# Link-fault tests use network namespaces (ip, tc) and a firewall inside them (nft, for partitions:
# tests/netlab.py block); install what is missing where we can (root, Debian). As root the netns
# tests run and fail without these, so CI never skips them silently.
NEED=()
command -v tc >/dev/null 2>&1 || NEED+=(iproute2)
command -v nft >/dev/null 2>&1 || command -v iptables >/dev/null 2>&1 || NEED+=(nftables)
if [ ${#NEED[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[setup] installing ${NEED[*]} for the network-namespace tests"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${NEED[@]}") \
    || echo "[setup] could not install ${NEED[*]}: the network-namespace tests will fail"
fi

# `systemd-analyze verify` checks the units in jetson/ (tests/test_serve_systemd.py); install the
# systemd package where it is missing and we can (root, Debian). Nothing is enabled or started.
if ! command -v systemd-analyze >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[setup] installing systemd (systemd-analyze) for the unit-file test"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd) \
    || echo "[setup] could not install systemd: the unit-file test will be skipped"
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# The package is built in this venv with its pinned build requirements (--no-build-isolation below): the protobuf
# stubs are generated at build time by grpcio-tools, and pip's isolated build environment ignores the pins. Stubs
# from a newer grpcio-tools than the pinned grpcio refuse to import (grpcio-tools 1.85.4 against 1.85.1, 2026-12-06).
"${PIP[@]}" install -c constraints/ci.txt "pip>=23" "setuptools>=77" wheel grpcio-tools

# llama-cpp-python: build once per flavor and machine arch, then reuse the wheel.
WHEELS="$HOME_DIR/wheels/$FLAVOR-$(uname -m)"
if ! "$VENV/bin/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$LLAMA_VERSION')" 2>/dev/null; then
  if ! ls "$WHEELS"/llama_cpp_python-$LLAMA_VERSION-*.whl >/dev/null 2>&1; then
    echo "[setup] building llama-cpp-python $LLAMA_VERSION ($FLAVOR); this takes ~12 minutes once"
    mkdir -p "$WHEELS"
    CMAKE_ARGS="$LLAMA_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
      "${PIP[@]}" wheel --no-deps "llama-cpp-python==$LLAMA_VERSION" -w "$WHEELS"
  fi
  "${PIP[@]}" install -c constraints/ci.txt --no-deps "$WHEELS"/llama_cpp_python-$LLAMA_VERSION-*.whl
  "${PIP[@]}" install -c constraints/ci.txt "typing-extensions>=4.5" "diskcache>=5.6.1" "jinja2>=2.11.3"
fi

# torch for the torch verifier backend: pinned explicitly first, so that the `torch` extra below is
# already satisfied (an unpinned `torch` would pull the multi-GB CUDA build on a CPU machine).
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  echo "[setup] installing torch 2.13.0"
  "${PIP[@]}" install -c constraints/ci.txt "torch==2.13.0"
fi

# Its core dependencies include llguidance (grammar / JSON-schema constraints), pinned in constraints/ci.txt.
echo "[setup] installing edgespec and its dependencies"
"${PIP[@]}" install -c constraints/ci.txt --no-build-isolation -e ".[edge,verifier,dev,bench,torch,router,distill]"

# PII masking (issue 11): presidio + spaCy + its small English model as pip packages (nothing is
# downloaded at run time), and tcpdump for the loopback capture in tests/test_privacy_wire.py.
"${PIP[@]}" install -c constraints/ci.txt --no-build-isolation -e ".[privacy]"
if ! command -v tcpdump >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[setup] installing tcpdump for the PII wire-capture test"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends tcpdump) \
    || echo "[setup] could not install tcpdump: the packet-capture test will fail"
fi

for m in $MODELS; do
  "$VENV/bin/edgespec" models fetch "$m"
done
echo "[setup] done: $VENV/bin/edgespec is ready"
