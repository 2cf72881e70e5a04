#!/bin/bash
# vLLM's own served / in-process output throughput at c=32 on this host: the reference
# for the mesh's `mesh_overhead` ratio (same model, fp32, 128 in / 64 out, ignore_eos).
#
#   bench/vllm_serving_ratio.sh ROUND LAYOUT OUT_DIR
#
# LAYOUT: reserved1 = vLLM's default on CPU (one core kept for the API server, the engine's
# compute threads on the others); reserved0 = VLLM_CPU_NUM_OF_RESERVED_CPU=0 (every core
# computes, the API server shares them, as the mesh's processes share them in
# `mesh_overhead`). In-process: `vllm bench throughput` with the engine core in the
# caller's process (VLLM_ENABLE_V1_MULTIPROCESSING=0), 256 prompts queued, at most 32
# running (--max-num-seqs 32). Served: `vllm serve --max-num-seqs 32` driven by
# `vllm bench serve --max-concurrency 32`. Needs the vLLM peer of
# ../shared/peers/vllm-cpu/RECIPE.md in /tmp/peer (venv, tiny-llama, serve.sh, wait_up.sh).
set -u
R=$1; L=$2; OUT=$3
PEER=${PEER:-/tmp/peer}
cd "$PEER"
export HF_HUB_OFFLINE=1
LENV=""; [ "$L" = reserved0 ] && LENV="VLLM_CPU_NUM_OF_RESERVED_CPU=0"
mkdir -p "$OUT"
env $LENV VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 timeout 900 ./venv/bin/vllm bench throughput \
  --backend vllm --model "$PEER/tiny-llama" --dataset-name random --random-input-len 128 --random-output-len 64 \
  --num-prompts 256 --max-num-seqs 32 --dtype float32 --max-model-len 1024 \
  --output-json "$OUT/v_${L}_r${R}_off.json" > "$OUT/v_${L}_r${R}_off.log" 2>&1
echo "offline rc=$?"
env $LENV DTYPE=float32 setsid nohup ./serve.sh --max-num-seqs 32 > "$OUT/v_${L}_r${R}_serve.log" 2>&1 &
./wait_up.sh
timeout 900 ./venv/bin/vllm bench serve --backend vllm --base-url http://127.0.0.1:8011 --endpoint /v1/completions \
  --model tiny-llama --tokenizer "$PEER/tiny-llama" --dataset-name random --random-input-len 128 --random-output-len 64 \
  --random-range-ratio 0 --num-prompts 256 --request-rate inf --max-concurrency 32 --ignore-eos --seed 0 \
  --save-result --result-dir "$OUT" --result-filename "v_${L}_r${R}_served.json" > "$OUT/v_${L}_r${R}_served.log" 2>&1
echo "served rc=$?"
kill -TERM "$(cat "$PEER/serve.pid")"; sleep 6; pkill -f "vllm serve"; sleep 2
