#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine (CI has none): the CUDA tests
# (tests/integration/engines/test_gpu.py); with 2 GPUs or more the parallel equality tests on NCCL (tensor,
# context and expert parallel ranks against one process: the same tests CI runs on gloo, here
# with a GPU per rank; 4-rank runs need 4 GPUs); the Megatron backend on CUDA without the CPU
# harness against the FSDP backend (one GPU: one process; 2 GPUs: t2, p2 and d2; 4: d1t2p2),
# and its tokens/s beside FSDP's (bench/bench_parallel.py); and, with --demo, a short
# `rlgateway demo`. The machine carries PyTorch; rlgateway's other dependencies travel as wheels
# in .whl/ (megatron-core among them: pip download megatron-core==0.16.1 --no-deps).
set -o pipefail
out=${OUT:-/tmp/gpu-check}; mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export RLGATEWAY_CACHE_DIR=/tmp/rlgateway-cache PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
timeout 300 python3 -m pytest -q -s -p no:cacheprovider -o addopts="" \
  -W ignore::DeprecationWarning -W ignore::UserWarning -W ignore::FutureWarning \
  tests/integration/engines/test_gpu.py 2>&1 | tee "$out/gpu-tests.log" | tail -25
gpus=$(nvidia-smi -L | wc -l)
megatron=tests/integration/trainer/test_megatron.py
one=(test_the_logits_equal_the_hugging_face_models test_training_equals_the_fsdp_backend
  test_a_megatron_checkpoint_resumes_exactly_and_exports)
timeout 600 python3 -m pytest -q -s -p no:cacheprovider -o addopts="" \
  -W ignore::DeprecationWarning -W ignore::UserWarning -W ignore::FutureWarning \
  "${one[@]/#/$megatron::}" -k "qwen2 and megatron and not t2 and not p2 and not d2" 2>&1 \
  | tee "$out/megatron-tests.log" | tail -25
timeout 900 python3 bench/bench_parallel.py --rounds 2 --cores 8 \
  --only fsdp megatron $([ "$gpus" -ge 2 ] && echo fsdp:t2 megatron:t2 megatron:p2) 2>&1 \
  | tee "$out/bench-parallel.log" | tail -30
parallel="tests/integration/trainer/test_tensor_parallel.py tests/integration/trainer/test_context_parallel.py
  tests/integration/trainer/test_expert_parallel.py tests/integration/trainer/test_megatron.py"
if [ "$gpus" -ge 2 ]; then
  only=""  # the 4-rank runs: d2t2, d2c2, c2t2, d4e2, d1t2p2
  [ "$gpus" -lt 4 ] && only="not d2t2 and not d2c2 and not c2t2 and not d4e2 and not d1t2p2"
  # shellcheck disable=SC2086
  timeout 1200 python3 -m pytest -q -s -p no:cacheprovider -o addopts="" -k "$only" \
    -W ignore::DeprecationWarning -W ignore::UserWarning -W ignore::FutureWarning \
    $parallel 2>&1 | tee "$out/parallel-tests.log" | tail -25
else
  echo "parallel equality tests on NCCL: a GPU per rank needed, $gpus GPU(s) here: not run" \
    | tee "$out/parallel-tests.log"
fi
if [ "${1:-}" = "--demo" ]; then
  timeout 420 python3 -m rlgateway.cli demo --minutes "${DEMO_MINUTES:-3}" --out "$out/demo" 2>&1 \
    | grep -v "Loading\|Writing" | tee "$out/demo.log" | tail -60
fi
