#!/usr/bin/env bash
# specdec's server against llama.cpp's llama-server, end to end, plain and speculative, on the same prompts in the
# same minutes (python -m specdec.bench.server_compare sends the requests, interleaved, greedy).
#
#   scripts/compare_servers.sh pair    # Qwen2.5-Coder-1.5B target, 0.5B draft model; HumanEval dev prompts
#   scripts/compare_servers.sh ngram   # Gemma-3-270M, n-gram drafts; held-out Spec-Bench chat prompts
#
# Four servers: specdec plain and speculative, llama-server plain and speculative (`-md` with the same draft
# GGUF for pair, `--spec-type ngram-mod` for ngram). Each speculative server's texts are compared with its own
# plain server's. Environment:
#   LLAMA_BIN   llama.cpp's bin directory (default .peers/llama.cpp/build-native/bin; scripts/install-peers.sh
#               builds it, and build-avx2/bin, the AVX2-only peer of SPECDEC_KERNEL_ISA=avx2)
#   SPECDEC_KERNEL_ISA, THREADS (default 2), MAX_TOKENS (default 256 for pair, 128 for ngram),
#   PER_CATEGORY (prompts per category: default 8 for pair, 2 for ngram), K (draft length cap: default 8 for
#   pair, 16 for ngram), OUT (default bench_results/compare-servers-MODE.json), DRAFT_FORMAT (pair: the draft
#   model's --weight-format, e.g. q4; default the target's)
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:?usage: scripts/compare_servers.sh pair|ngram}
LLAMA_BIN=${LLAMA_BIN:-.peers/llama.cpp/build-native/bin}
THREADS=${THREADS:-2}
PY=.venv/bin/python
[ -x "$LLAMA_BIN/llama-server" ] || { echo "no llama-server in $LLAMA_BIN: run PEERS=llama-bin scripts/install-peers.sh" >&2; exit 2; }
gguf() { "$PY" -c "import sys; from specdec.models.catalog import resolve_model; print(resolve_model(sys.argv[1]))" "$1"; }

case $MODE in
  pair)
    TARGET=qwen2.5-coder-1.5b-instruct DRAFT=qwen2.5-coder-0.5b-instruct K=${K:-8}
    MAX_TOKENS=${MAX_TOKENS:-256} PER_CATEGORY=${PER_CATEGORY:-8}
    DATASET=(--dataset ../shared/data/humaneval_dev.jsonl)
    SPEC_CONFIG="{\"method\": \"draft_model\", \"model\": \"$DRAFT\", \"num_speculative_tokens\": $K${DRAFT_FORMAT:+, \"weight_format\": \"$DRAFT_FORMAT\"}}"
    LLAMA_SPEC=(-md "$(gguf "$DRAFT")" -td "$THREADS" --spec-draft-n-max "$K") ;;
  ngram)
    TARGET=gemma-3-270m K=${K:-16} MAX_TOKENS=${MAX_TOKENS:-128} PER_CATEGORY=${PER_CATEGORY:-2}
    DATASET=(--dataset ../shared/data/spec_bench_dev.jsonl --held-out-of 4
             --categories writing,translation,summarization,qa,math_reasoning,rag)
    SPEC_CONFIG="{\"method\": \"ngram\", \"num_speculative_tokens\": $K}"
    LLAMA_SPEC=(--spec-type ngram-mod) ;;
  *) echo "unknown mode $MODE (pair, ngram)" >&2; exit 2 ;;
esac
OUT=${OUT:-bench_results/compare-servers-$MODE.json}
mkdir -p "$(dirname "$OUT")"
TARGET_GGUF=$(gguf "$TARGET")

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
logdir=$(mktemp -d)
.venv/bin/specdec serve "$TARGET" --port 8101 --threads "$THREADS" >"$logdir/specdec-plain.log" 2>&1 & pids+=($!)
.venv/bin/specdec serve "$TARGET" --port 8102 --threads "$THREADS" --speculative-config "$SPEC_CONFIG" \
  >"$logdir/specdec-spec.log" 2>&1 & pids+=($!)
"$LLAMA_BIN/llama-server" -m "$TARGET_GGUF" -t "$THREADS" -c 4096 -np 1 --port 8103 >"$logdir/llama-plain.log" 2>&1 & pids+=($!)
"$LLAMA_BIN/llama-server" -m "$TARGET_GGUF" -t "$THREADS" -c 4096 -np 1 --port 8104 "${LLAMA_SPEC[@]}" \
  >"$logdir/llama-spec.log" 2>&1 & pids+=($!)
for port in 8101 8102 8103 8104; do
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    sleep 1
  done
  curl -sf "http://127.0.0.1:$port/health" >/dev/null || { echo "server on port $port did not start; logs in $logdir" >&2; exit 1; }
done
echo "servers up (logs in $logdir); $MODE: $TARGET, $SPEC_CONFIG / llama-server ${LLAMA_SPEC[*]}" >&2
"$PY" -m specdec.bench.server_compare "${DATASET[@]}" --per-category "$PER_CATEGORY" --max-tokens "$MAX_TOKENS" \
  --server specdec-plain=http://127.0.0.1:8101 --server "specdec-$MODE=http://127.0.0.1:8102" \
  --server llama-plain=http://127.0.0.1:8103 --server "llama-$MODE=http://127.0.0.1:8104" \
  --same "specdec-plain,specdec-$MODE" --same "llama-plain,llama-$MODE" --json "$OUT"
