#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# vLLM's own benchmarks with and without --kv-manager infinigen:
#   vllm bench throughput   (offline, random dataset)
#   vllm bench latency      (offline, one batch, dummy prompt ids)
#   vllm bench serve        (against a `vllm serve` this script starts, random dataset)
#
#   benchmarks/perf/vllm_bench.sh [MODEL]       (default: the bundled stories260K)
#   benchmarks/perf/vllm_bench.sh --serve-rounds N [MODEL]
#       `vllm bench serve` alone, stock and InfiniGen in alternation N times, into
#       benchmarks/results/vllm_bench_serve_rounds.md (each round's ratio, their median)
#
# Writes benchmarks/results/vllm_bench_<bench>_<kv manager>.json (vLLM's own
# result files, to which the summary adds a "meta" entry), .txt (date, commit,
# machine, the command and the result lines of its output), and
# vllm_bench.{json,md} (a summary, python -m benchmarks.perf.vllm_bench_report).
# Full logs go to benchmarks/results/tmp/ (not committed).
#
# `vllm bench latency` draws prompt ids below 10,000 (vllm/benchmarks/latency.py),
# which the bundled model's 512-token vocabulary refuses; the script runs
# latency on a random Llama with a 10,240-token vocabulary
# (benchmarks/harness/models.build_wide_vocab_llama) instead.
#
# Every engine start takes the lock $LOCK (default /tmp/engine.lock) so that
# engines of other jobs on this machine do not run at the same time; do not
# run this script itself under the same lock.
#
# Environment: PYTHON (default: .venv/bin/python, else the interpreter next to
# `vllm` on PATH), VLLM (default: `vllm` next to $PYTHON), LOCK, NUM_PROMPTS (32),
# INPUT_LEN (128), OUTPUT_LEN (128), KV_BYTES (33554432). The random dataset
# re-tokenizes its prompts, which can lengthen them with the bundled model's
# small tokenizer (at seed 0: 128 -> at most 173 tokens, 160 -> 475): keep
# INPUT_LEN well under max-model-len 512 - OUTPUT_LEN.

set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
MODEL="${1:-$REPO/vllm_infinigen/assets/stories260k}"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"
  elif command -v vllm >/dev/null; then PYTHON="$(dirname "$(command -v vllm)")/python"
  else PYTHON=python3; fi
fi
VLLM="${VLLM:-$(dirname "$PYTHON")/vllm}"
LOCK="${LOCK:-/tmp/engine.lock}"
NUM_PROMPTS="${NUM_PROMPTS:-32}"
INPUT_LEN="${INPUT_LEN:-128}"
OUTPUT_LEN="${OUTPUT_LEN:-128}"
KV_BYTES="${KV_BYTES:-33554432}"
RESULTS="$REPO/benchmarks/results"
# How this run was started, for the summary's provenance.
COMMAND="bash benchmarks/perf/vllm_bench.sh${1:+ $1}"
# (and the OpenMP and vLLM CPU thread settings the workers inherit, when set)
for name in NUM_PROMPTS INPUT_LEN OUTPUT_LEN KV_BYTES GOMP_SPINCOUNT OMP_WAIT_POLICY \
    VLLM_CPU_OMP_THREADS_BIND; do
  if [ -n "${!name:-}" ]; then COMMAND="$name=${!name} $COMMAND"; fi
done
LOGS="$RESULTS/tmp/vllm_bench"
mkdir -p "$LOGS"
# Prompt ids within the bundled model's vocabulary have no effect on timing.
COMMON=(--dtype float32 --max-model-len 512 --kv-cache-memory-bytes "$KV_BYTES" --seed 0)
INFINIGEN=(--kv-manager infinigen --infinigen-budget 0.2)
# Lines of a benchmark's output worth keeping in the .txt next to its JSON.
KEEP='Throughput|latency|Latency|percentile|InfiniGen: |Maximum concurrency|Error|error:|=====|Successful|Failed|duration|throughput|TTFT|TPOT|ITL|E2EL|Total|Mean|Median|P[0-9][0-9]'

log() { printf '[%(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

with_lock() {  # run "$@" holding the engine lock
  if command -v flock >/dev/null; then flock "$LOCK" "$@"; else "$@"; fi
}

keep_results() {  # keep_results NAME COMMAND...: runs it, keeps the result lines
  local name="$1"; shift
  local full="$LOGS/$name.log" status=0
  local started commit
  started="$(date -u +%Y-%m-%dT%H:%M:%S+00:00)"
  commit="$(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)"
  # (the results this script rewrites are not the code's changes)
  if [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no -- . \
      ':!benchmarks/results' 2>/dev/null)" ]; then
    commit="$commit + uncommitted changes"
  fi
  log "$name: $*"
  with_lock "$@" >"$full" 2>&1 || status=$?
  {
    echo "# date (UTC): $started"
    echo "# repository commit: $commit"
    echo "# machine: $(uname -srm), $(nproc) CPUs"
    echo "\$ $*"
    echo "exit code: $status"
    grep -E 'InfiniGen: |Maximum concurrency' "$full" | head -n 4 || true
    grep -E "$KEEP" "$full" | grep -vE '(INFO|DEBUG|WARNING) [0-9]{2}-[0-9]{2} ' || true
    if [ "$status" -ne 0 ]; then echo "--- last lines ---"; tail -n 25 "$full"; fi
  } >"$RESULTS/$name.txt"
  log "$name: exit code $status (log: $full)"
  return 0
}

serve_and_bench() {  # (under the lock) starts vllm serve, runs vllm bench serve, stops it
  local manager="$1" port="$2"; shift 2
  local server_log="$LOGS/serve_$manager.server.log"
  "$VLLM" serve "$MODEL" --host 127.0.0.1 --port "$port" "${COMMON[@]}" "$@" \
    >"$server_log" 2>&1 &
  local pid=$!
  local ready=0
  for _ in $(seq 1 300); do
    if ! kill -0 "$pid" 2>/dev/null; then break; fi
    if curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; then ready=1; break; fi
    sleep 1
  done
  local status=1
  if [ "$ready" = 1 ]; then
    status=0
    "$VLLM" bench serve --backend vllm --base-url "http://127.0.0.1:$port" --model "$MODEL" \
      --dataset-name random --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
      --num-prompts "$NUM_PROMPTS" --max-concurrency 16 --ignore-eos --seed 0 \
      --save-result --result-dir "$RESULTS" --result-filename "vllm_bench_serve_$manager.json" \
      || status=$?
    grep -E 'InfiniGen: |Maximum concurrency' "$server_log" | head -n 4 || true
  else
    echo "vllm serve did not become healthy; last lines of its log:"; tail -n 25 "$server_log"
  fi
  kill -INT "$pid" 2>/dev/null || true
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  return "$status"
}

if [ "${1:-}" = "--serve-one" ]; then  # internal: one serve benchmark (already locked)
  shift; MODEL="$1"; manager="$2"; port="$3"; shift 3
  serve_and_bench "$manager" "$port" "$@"
  exit $?
fi

if [ "${1:-}" = "--serve-rounds" ]; then  # paired: stock, infinigen, stock, ... N rounds
  rounds="${2:-}"; MODEL="${3:-$REPO/vllm_infinigen/assets/stories260k}"
  if ! [[ "$rounds" =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 --serve-rounds N [MODEL] (N: rounds, at least 1)" >&2; exit 2
  fi
  out="$RESULTS/vllm_bench_serve_rounds.md"
  commit="$(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)"
  if [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no -- . \
      ':!benchmarks/results' 2>/dev/null)" ]; then
    commit="$commit + uncommitted changes"
  fi
  command="${COMMAND%" --serve-rounds"} --serve-rounds $rounds${3:+ $3}"
  cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
  {
    echo "# vllm bench serve, stock and InfiniGen in alternation"
    echo
    echo "- command: \`$command\`"
    echo "- repository commit: $commit"
    echo "- machine: $(uname -srm), $(nproc) CPUs ($cpu)"
    echo "- date (UTC): $(date -u +%Y-%m-%dT%H:%M:%S+00:00)"
    echo "- model: ${MODEL#"$REPO"/}; $NUM_PROMPTS prompts of $INPUT_LEN + $OUTPUT_LEN" \
      "random tokens, --max-concurrency 16 (both engines hold 16 requests at once)," \
      "${COMMON[*]}; InfiniGen: ${INFINIGEN[*]}"
    echo
    echo "Each round starts \`vllm serve\` for stock vLLM, benchmarks it and stops it," \
      "then the same for InfiniGen: a slow spell of this shared host hits a round's" \
      "two runs alike, and each round gives its own ratio (- where a run failed)."
    echo
    echo "| round | stock requests/s | InfiniGen requests/s | ratio | stock TPOT ms" \
      "| InfiniGen TPOT ms | stock TTFT ms | InfiniGen TTFT ms |"
    echo "|---|---|---|---|---|---|---|---|"
  } >"$out"
  port_base=$((20000 + RANDOM % 20000))
  value() {  # value PATTERN LOG: the last word of the line, - where the run failed
    local got; got="$(grep -E "$1" "$2" | awk '{print $NF}' || true)"; echo "${got:--}"
  }
  ratios=()
  for round in $(seq 1 "$rounds"); do
    row=("$round")
    for manager in vllm infinigen; do
      extra=(); [ "$manager" = infinigen ] && extra=("${INFINIGEN[@]}")
      name="rounds_${manager}_$round"  # its server log: $LOGS/serve_$name.server.log
      log="$LOGS/serve_$name.log"
      with_lock bash "${BASH_SOURCE[0]}" --serve-one "$MODEL" "$name" \
        "$((port_base + round * 2 + ${#manager} % 2))" "${extra[@]}" >"$log" 2>&1 || true
      rm -f "$RESULTS/vllm_bench_serve_$name.json"
      row+=("$(value 'Request throughput' "$log")" "$(value 'Mean TPOT' "$log")" \
            "$(value 'Mean TTFT' "$log")")
    done
    ratio=-
    if [ "${row[1]}" != - ] && [ "${row[4]}" != - ]; then
      ratio="$(awk -v a="${row[1]}" -v b="${row[4]}" 'BEGIN { printf "%.2f", b / a }')"
      ratios+=("$ratio")
    fi
    echo "| ${row[0]} | ${row[1]} | ${row[4]} | $ratio | ${row[2]} | ${row[5]}" \
      "| ${row[3]} | ${row[6]} |" >>"$out"
    log "round $round: stock ${row[1]}, InfiniGen ${row[4]} requests/s ($ratio)"
  done
  {
    echo
    if [ "${#ratios[@]}" -eq 0 ]; then
      echo "No round completed both runs: see the logs."
    else
      median="$(printf '%s\n' "${ratios[@]}" | sort -g | awk '{v[NR] = $1} END {
        if (NR % 2) print v[(NR + 1) / 2]; else printf "%.2f", (v[NR / 2] + v[NR / 2 + 1]) / 2 }')"
      echo "InfiniGen's requests/s over stock's: median over the ${#ratios[@]} complete" \
        "rounds **${median}x** (rounds: ${ratios[*]})."
    fi
    echo "Full logs: benchmarks/results/tmp/vllm_bench/serve_rounds_* (not committed)."
  } >>"$out"
  log "wrote $out"
  exit 0
fi

# -- throughput ------------------------------------------------------------------
for manager in vllm infinigen; do
  extra=(); [ "$manager" = infinigen ] && extra=("${INFINIGEN[@]}")
  keep_results "vllm_bench_throughput_$manager" "$VLLM" bench throughput --model "$MODEL" \
    --dataset-name random --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
    --num-prompts "$NUM_PROMPTS" "${COMMON[@]}" "${extra[@]}" \
    --output-json "$RESULTS/vllm_bench_throughput_$manager.json"
done

# -- latency ---------------------------------------------------------------------
# `vllm bench latency` draws prompt ids below 10,000: a model with a smaller
# vocabulary fails ("Token id ... is out of vocabulary"); latency runs on a
# random tiny Llama with a 10,240-token vocabulary instead.
WIDE="$LOGS/wide-vocab-llama"
if [ ! -f "$WIDE/config.json" ]; then
  (cd "$REPO" && "$PYTHON" -c "import sys; from pathlib import Path; from benchmarks.harness.models import build_wide_vocab_llama as b; b(Path(sys.argv[1]))" "$WIDE")
fi
for manager in vllm infinigen; do
  extra=(); [ "$manager" = infinigen ] && extra=("${INFINIGEN[@]}")
  keep_results "vllm_bench_latency_$manager" "$VLLM" bench latency --model "$WIDE" \
    --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --batch-size 4 --num-iters-warmup 1 \
    --num-iters 3 "${COMMON[@]}" "${extra[@]}" \
    --output-json "$RESULTS/vllm_bench_latency_$manager.json"
done

# -- serve -----------------------------------------------------------------------
port_base=$((20000 + RANDOM % 20000))
for manager in vllm infinigen; do
  extra=(); [ "$manager" = infinigen ] && extra=("${INFINIGEN[@]}")
  port=$((port_base + ${#manager}))
  keep_results "vllm_bench_serve_$manager" bash "${BASH_SOURCE[0]}" --serve-one "$MODEL" \
    "$manager" "$port" "${extra[@]}"
done

(cd "$REPO" && "$PYTHON" -m benchmarks.perf.vllm_bench_report --model "$MODEL" --wide-model "$WIDE" \
  --command "$COMMAND")
