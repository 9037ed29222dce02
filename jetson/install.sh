#!/usr/bin/env bash
# Install edgespec as a service on a Jetson (JetPack 6, Orin: CUDA sm_87). Run as root from a checkout:
#   sudo jetson/install.sh                 # device daemon (edgespec-edge), enabled and started
#   sudo jetson/install.sh --verifier      # also the verifier unit (a Jetson serving other devices)
#   jetson/install.sh --dry-run            # print the commands, change nothing (any machine, no root)
# Layout: code /opt/edgespec/src, venv /opt/edgespec/venv, models and state /var/lib/edgespec,
# settings /etc/edgespec/{edgespec.toml,edgespec.env}, units /etc/systemd/system. Idempotent:
# existing settings are kept, the llama.cpp wheel is built once (about 30-60 min on an Orin).
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=$PWD
PREFIX=${EDGESPEC_PREFIX:-/opt/edgespec}
STATE=/var/lib/edgespec
CUDA_ARCH=${EDGESPEC_CUDA_ARCH:-87}
LLAMA_VERSION=0.3.36
DRY=0 VERIFIER=0 START=1
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --verifier) VERIFIER=1 ;;
    --no-start) START=0 ;;
    *) echo "usage: $0 [--dry-run] [--verifier] [--no-start]" >&2; exit 2 ;;
  esac
done
run() { echo "+ $*"; [ "$DRY" = 1 ] || "$@"; }
if [ "$DRY" = 0 ] && [ "$(id -u)" != 0 ]; then echo "run as root (or --dry-run)" >&2; exit 2; fi
if [ "$DRY" = 0 ] && [ "$(uname -m)" != aarch64 ]; then
  echo "warning: $(uname -m) is not a Jetson; continuing with CUDA arch sm_$CUDA_ARCH" >&2
fi

# 1. system packages and the service user (group video: the GPU's device nodes)
run apt-get install -y --no-install-recommends python3-venv python3-dev cmake build-essential rsync
if ! id edgespec >/dev/null 2>&1; then
  run useradd --system --home-dir "$STATE" --shell /usr/sbin/nologin --user-group edgespec
fi
for g in video render; do
  if getent group "$g" >/dev/null; then run usermod -a -G "$g" edgespec; fi
done
run install -d -o edgespec -g edgespec -m 0750 "$STATE"
run install -d -m 0755 "$PREFIX"

# 2. code and virtualenv; llama-cpp-python built with CUDA for this GPU (wheel cached in $STATE/wheels)
run rsync -a --delete --exclude .git --exclude .venv --exclude '*.egg-info' "$SRC/" "$PREFIX/src/"
[ -x "$PREFIX/venv/bin/python" ] || run python3 -m venv "$PREFIX/venv"
PIP=("$PREFIX/venv/bin/python" -m pip --disable-pip-version-check -q)
WHEELS="$STATE/wheels/cuda-sm$CUDA_ARCH"
if ! ls "$WHEELS"/llama_cpp_python-$LLAMA_VERSION-*.whl >/dev/null 2>&1; then
  run install -d "$WHEELS"
  run env CUDACXX=/usr/local/cuda/bin/nvcc CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH -DLLAVA_BUILD=OFF" \
    "${PIP[@]}" wheel --no-deps "llama-cpp-python==$LLAMA_VERSION" -w "$WHEELS"
fi
run "${PIP[@]}" install -c "$PREFIX/src/constraints/ci.txt" "pip>=23" "setuptools>=77" wheel
run sh -c "\"$PREFIX/venv/bin/python\" -m pip install -q --no-deps $WHEELS/llama_cpp_python-$LLAMA_VERSION-*.whl"
run "${PIP[@]}" install -c "$PREFIX/src/constraints/ci.txt" "typing-extensions>=4.5" "diskcache>=5.6.1" "jinja2>=2.11.3"
# the edge extra only: no torch (JetPack's torch is NVIDIA's build, not PyPI's), no dev tools
run "${PIP[@]}" install -c "$PREFIX/src/constraints/ci.txt" "$PREFIX/src[edge]"

# 3. models, fetched and checksummed as the service user
run runuser -u edgespec -- env EDGESPEC_HOME="$STATE" "$PREFIX/venv/bin/edgespec" models fetch default

# 4. settings (kept if present) and units
run install -d -m 0755 /etc/edgespec
[ -e /etc/edgespec/edgespec.toml ] || run install -m 0644 "$SRC/jetson/edgespec.toml" /etc/edgespec/edgespec.toml
if [ ! -e /etc/edgespec/edgespec.env ]; then   # secrets: readable by the service, not by everyone
  run install -m 0640 -g edgespec /dev/null /etc/edgespec/edgespec.env
  run sh -c "printf '%s\n' '# EDGESPEC_EDGE_TOKEN=...' '# EDGESPEC_SERVE_API_KEY=...' >> /etc/edgespec/edgespec.env"
fi
UNITS=(edgespec-edge.service)
if [ "$VERIFIER" = 1 ]; then UNITS+=(edgespec-verifier.service); fi
for unit in "${UNITS[@]}"; do
  run install -m 0644 "$SRC/jetson/$unit" "/etc/systemd/system/$unit"
  run systemd-analyze verify "/etc/systemd/system/$unit"
done
run systemctl daemon-reload

# 5. check, then start
run runuser -u edgespec -- env EDGESPEC_HOME="$STATE" "$PREFIX/venv/bin/edgespec" doctor --config /etc/edgespec/edgespec.toml || true
if [ "$START" = 1 ]; then
  run systemctl enable --now "${UNITS[@]}"
fi
echo "done: systemctl status edgespec-edge; journalctl -u edgespec-edge -f; curl http://127.0.0.1:8080/health"
