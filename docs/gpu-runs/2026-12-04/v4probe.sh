#!/usr/bin/env bash
# Where the tiny DeepSeek-V4's first forward hits "illegal instruction": base
# server, CUDA_LAUNCH_BLOCKING=1, graphs for bs 1 only; then the same with
# DeepGEMM's hc-prenorm GEMM off (SGLANG_OPT_DEEPGEMM_HC_PRENORM=0).
set -u
source .gpu/device_env.sh
source scripts/dsv4_env.sh || exit 1
export SGLANG_OPT_FP8_WO_A_GEMM=0
python3 -m pip install -q --no-deps --no-build-isolation --no-index --no-compile --target /tmp/proj . >/dev/null 2>&1
rm -rf ./*.egg-info build
export PYTHONPATH=/tmp/proj:$PYTHONPATH
launch() {  # launch NAME ENV...: until it dies, is ready, or V4_T seconds pass
  local name=$1; shift
  local s=$(date +%s)
  env "$@" CUDA_LAUNCH_BLOCKING=1 python3 -m sglang.launch_server --port 30010 --host 127.0.0.1 \
    --model-path tests/data/tiny-dsv4 --load-format dummy --skip-tokenizer-init --disable-radix-cache \
    --kv-cache-dtype fp8_e4m3 --mem-fraction-static 0.35 --max-running-requests 8 --max-total-tokens 65536 \
    --context-length 32768 --skip-server-warmup --cuda-graph-max-bs 1 --disable-piecewise-cuda-graph \
    > "$OUT/$name.log" 2>&1 &
  local pid=$! ready=no
  while kill -0 $pid 2>/dev/null && [ $(( $(date +%s) - s )) -lt "${V4_T:-150}" ]; do
    if grep -q 'fired up' "$OUT/$name.log"; then
      ready=yes
      curl -s -m 60 http://127.0.0.1:30010/generate -H 'Content-Type: application/json' \
        -d '{"input_ids": [5, 6, 7, 8, 9, 10, 11, 12], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}' \
        > "$OUT/$name.gen.json"; echo "   generate: $(head -c 300 "$OUT/$name.gen.json")"
      break
    fi
    sleep 2
  done
  pkill -f sglang.launch_server; sleep 3; pkill -9 -f sglang; sleep 1
  echo "== $name: ready $ready after $(( $(date +%s) - s )) s"
  grep -v 'Ignore import error' "$OUT/$name.log" | grep -E 'File "|Error|error:|Capture cuda graph end' | grep -v 'torch/nn/modules' | tail -14
}
launch blocking
launch noprenorm SGLANG_OPT_DEEPGEMM_HC_PRENORM=0
