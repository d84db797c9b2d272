#!/bin/bash
# Bounded runs of guidellm, aiperf and inference-perf (shared prefix) against one running `pagoda up`,
# one after another, the worker's token counters read before and after each (issue 24; results in
# bench/RESULTS.md, "Third-party tools"). Each tool lives in a venv of its own under $VENVS
# (python3 -m venv $VENVS/TOOL && $VENVS/TOOL/bin/pip install TOOL; inference-perf needs Python 3.12);
# this script installs nothing. guidellm is also in the test extra (tests/test_guidellm.py): without
# $VENVS/guidellm the one on PATH runs.
# usage: bench/third_party.sh HTTP_BASE WORKER_METRICS_URL MODEL_DIR OUT_DIR
#   e.g. bench/third_party.sh http://127.0.0.1:43161 http://127.0.0.1:34201/metrics ~/.cache/pagoda/tiny-llama /tmp/tp
set -u
HTTP=$1; METRICS=$2; MODEL_DIR=$3; OUT=$4
mkdir -p $OUT
counters() { curl -s $METRICS | grep -E '^pagoda:(prompt_tokens_total|prompt_tokens_cached_total|generation_tokens_total)' | awk '{printf "%s=%s ", $1, $2}'; echo; }
GUIDELLM=${VENVS:-/work/venvs}/guidellm/bin/guidellm; [ -x "$GUIDELLM" ] || GUIDELLM=guidellm
echo "== guidellm"; counters
HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $GUIDELLM run --backend kind=openai_http,target=$HTTP,model=tiny-llama \
  --profile kind=constant,rate=2 --constraint kind=max_requests,count=20 --tokenizer kind=hf_auto,model=$MODEL_DIR \
  --data kind=synthetic_text,prompt_tokens=64,output_tokens=32 --output kind=json,path=$OUT/guidellm.json \
  --disable-console-interactive > $OUT/guidellm.log 2>&1; echo "rc=$?"; counters
echo "== aiperf"; counters
${VENVS:-/work/venvs}/aiperf/bin/aiperf profile --model tiny-llama --url $HTTP --endpoint-type chat --streaming --tokenizer $MODEL_DIR \
  --request-count 40 --concurrency 2 --synthetic-input-tokens-mean 64 --synthetic-input-tokens-stddev 0 --output-tokens-mean 32 \
  --output-tokens-stddev 0 --extra-inputs ignore_eos:true --use-server-token-count --per-chunk-usage --max-workers 1 \
  --server-metrics $METRICS --artifact-dir $OUT/aiperf --ui-type none > $OUT/aiperf.log 2>&1; echo "rc=$?"; counters
echo "== inference-perf"; counters
cat > $OUT/ip.yaml <<YAML
load: {type: constant, stages: [{rate: 2, duration: 10}]}
api: {type: completion, streaming: true}
server: {type: vllm, model_name: tiny-llama, base_url: $HTTP, ignore_eos: true}
tokenizer: {pretrained_model_name_or_path: $MODEL_DIR}
data:
  type: shared_prefix
  shared_prefix: {num_groups: 2, num_prompts_per_group: 5, system_prompt_len: 100, question_len: 50, output_len: 20}
report: {request_lifecycle: {summary: true, per_stage: true, per_request: true}}
storage: {local_storage: {path: $OUT/ip}}
YAML
${VENVS:-/work/venvs}/inference-perf/bin/inference-perf --config_file $OUT/ip.yaml > $OUT/ip.log 2>&1; echo "rc=$?"; counters
