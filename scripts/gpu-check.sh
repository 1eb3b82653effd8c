#!/usr/bin/env bash
# What only a GPU can prove about the CUDA tiers, run on a machine with a GPU and the CUDA 13
# libraries from the bundle `make gpu-bundle` builds (README, "GPU build and gpu-check"). No
# cargo, no network needed. Two ways to run it:
#
#   scripts/gpu-check.sh lease [--budget SECONDS] [options]     (`make gpu-lease`)
#       One call for one GPU lease: the phases below in priority order (env, kernels, bench,
#       tiers, profile, server, http, sanitizer; `llama` after kernels with --with-llama), each
#       skipped with a line in the report when the budget left (default 480 s) is below its
#       estimate, each under `timeout` of the budget left. <out>/gpu-lease.json and
#       gpu-lease.md (first line: the verdict, and why when it failed) and <out>/raw.tar.xz (the
#       phases' records, logs and figures, each clipped) are rewritten after every phase, so a
#       run cut off still leaves what finished. Exit status 1 when a phase failed. Our bench
#       figures are compared with llama.cpp's for this card from docs/bench-data/gpu-anchors.json
#       (a card without an anchor or a figure missing fails the bench phase).
#   scripts/gpu-check.sh PHASE [options]     PHASE: env kernels sanitizer tiers http llama bench
#                                            server speculation profile report all
#       One phase (each within 10 minutes) writing <out>/<phase>.json ({"phase", "status":
#       passed|failed|skipped, "seconds", "reason", "detail", "result"}) and its log; `report`
#       gathers them into <out>/gpu-check.json and .md; `all` (`make gpu-check`) runs every
#       phase and the report. Exit status 1 when a phase failed.
#
#   --bundle DIR     where the bundle's files are (default target/gpu-bundle)
#   --out DIR        where results go (default $OUT when set, else target/gpu-lease for the
#                    lease, target/gpu-check for phases)
#   --work DIR       models, llama.cpp's build, the lease's logs (default
#                    ${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/smolchat-gpu-check}; kept between calls)
#   --device D       cuda (default), or cpu: dry-runs bench, server, http and speculation on the
#                    tiny test file; the phases that need a GPU are skipped in a lease
#   --tarball FILE   llama.cpp source tarball for the `llama` phase (b9793, `make llama-tarball`)
#   --budget S       lease: seconds the whole call may take (default 480)
#   --with-llama     lease: build llama.cpp from --tarball (once per machine: the build stays in
#                    the work folder) and measure it beside us in the bench phase
#   --card NAME      lease: compare with this card's anchor instead of nvidia-smi's name
#   NVIDIA_SMI=PATH  the nvidia-smi to ask (a missing one means no GPU)
#
# Phases (estimates for the lease, in seconds, in `lease_plan` below):
#   env        the GPU, driver and libraries (nvidia-smi, ldd of the binaries), the bundle unpacked
#   kernels    every kernel of ours against its Rust twin, op by op over many step shapes (sampling
#              included); decode graphs replaying what eager steps compute; candle's CUDA
#              quantized matmul against the CPU; device selection (tests/gpu.rs)
#   sanitizer  compute-sanitizer memcheck and racecheck over the kernel test (when installed)
#   tiers      the fast tier against llama.cpp's logits and itself (batched = alone), the start-up
#              self-check keeping the fast tier
#   http       the server with --device cuda: a conversation streamed over SSE and stored, /v1
#              whole and streamed, /metrics naming the device and tier (scripts/gpu_http_check.py)
#   llama      builds llama.cpp's llama-bench, llama-batched-bench, llama-lookup and llama-server
#              with CUDA from --tarball, in the work folder
#   bench      `smolchat bench --device cuda` on the SmolLM3-3B shape (prefill 512, one sequence
#              decoding, 64 sequences), beside llama-bench and llama-batched-bench when built
#   server     the server at 1/8/32/64 concurrent conversations on the same file
#              (scripts/http_bench.py): time to first token, per-stream and aggregate speed; then
#              the same streams on /v1, and on llama-server (-np 64) when `llama` built it,
#              through one client (scripts/openai_load.py)
#   profile    where a step's time goes: the op-by-op profile of the 3B shape, and Nsight
#              Compute's per-kernel table (`ncu --csv`) of one `smolchat bench` run (prefill
#              512, then decode steps) when ncu is installed
#   speculation `smolchat bench --speculative` on the fast tier: the three workloads and the chat
#              (beside llama.cpp's `llama-lookup` on the same workloads when `llama` built it)
#              series, drafts off and on (verified inside decode graphs, drawn on the GPU), on the
#              SmolLM3-3B shape (with --device cpu: the tiny test file, few tokens)
# The phases' functions run in a child bash through `timeout` (exported): no caller in sight.
# shellcheck disable=SC2329
set -uo pipefail

phase=${1:-}
shift || true
bundle=
out=${OUT:-}
tarball=
device=cuda
budget=480
with_llama=
card=
work=${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/smolchat-gpu-check}
# Paths given on the command line are read from where the script was started.
abs() { case "$1" in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --bundle) bundle=$(abs "$2"); shift 2 ;;
    --out) out=$(abs "$2"); shift 2 ;;
    --work) work=$(abs "$2"); shift 2 ;;
    --tarball) tarball=$(abs "$2"); shift 2 ;;
    --device) device=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --with-llama) with_llama=1; shift ;;
    --card) card=$2; shift 2 ;;
    *) echo "gpu-check: unknown option $1" >&2; exit 2 ;;
  esac
done
[[ "$budget" =~ ^[0-9]+$ ]] || { echo "gpu-check: --budget takes whole seconds" >&2; exit 2; }
if [[ -n "$with_llama" && ( -z "$tarball" || ! -f "$tarball" ) ]]; then
  echo "gpu-check: --with-llama needs --tarball FILE (a llama.cpp b9793 source tarball)" >&2
  exit 2
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
self="$repo/scripts/gpu-check.sh"
cd "$repo" || exit 2
bundle=${bundle:-$repo/target/gpu-bundle}
if [[ -z "$out" ]]; then
  [[ "$phase" == lease ]] && out=$repo/target/gpu-lease || out=$repo/target/gpu-check
fi
work=$(abs "$work")
mkdir -p "$out" "$work"
# Seconds a phase may run (the lease passes the budget left).
limit=${GPU_CHECK_LIMIT:-570}
# The synthetic SmolLM3-3B-shape file (1.9 GB), made here, outside the output folder.
synth="$work/smollm3-3b-synth.gguf"
# Set by record when the phase it records failed: the exit status.
phase_failed=0
export bundle repo out tarball device work limit synth

# The CUDA 13 libraries: the GPU machine's PyTorch environment holds them.
if [[ -z "${LD_LIBRARY_PATH:-}" ]]; then
  for d in /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib; do
    [[ -d "$d" ]] && export LD_LIBRARY_PATH=$d
  done
fi

# compute-sanitizer and ncu ship with the toolkit, outside PATH on some machines.
export PATH=$PATH:/usr/local/cuda/bin:/usr/local/cuda/compute-sanitizer

# Unpacks the bundle's compressed binaries once.
unpack() {
  for f in "$bundle"/*.xz; do
    [[ -e "$f" ]] || continue
    local bin=${f%.xz}
    [[ -x "$bin" && "$bin" -nt "$f" ]] || { xz -dkf "$f" && chmod +x "$bin"; }
  done
}

# Writes <out>/<phase>.json: phase, status, seconds, reason (failed or skipped: one line),
# detail (the log's last lines), result (JSON).
record() {
  local name=$1 status=$2 seconds=$3 log=$4 extra=${5:-null}
  python3 "$repo/scripts/gpu_check.py" record "$out/$name.json" "$name" "$status" "$seconds" "$log" "$extra"
  [[ "$status" == failed ]] && phase_failed=1
  return 0
}

# Notes in a phase's log that its command ran out of time.
note_timeout() {
  local rc=$1 log=$2
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    echo "gpu-check: timed out after $limit s" >>"$log"
  fi
}

# Makes the synthetic 3B file once (atomically: a run cut off leaves no half file), with
# SmolLM2's tokenizer (from the repository's tiny test file) padded to the shape's vocabulary,
# so the server phases' prompts are real text of realistic lengths (the weights are the same as
# with the placeholder vocabulary, which made one token a byte).
make_model() {
  [[ -f "$model" ]] && return 0
  mkdir -p "$(dirname "$model")"
  local tokenizer="$repo/tests/data/smollm3-tiny-q8_0.gguf" with=()
  [[ -f "$tokenizer" ]] && with=(--tokenizer-from "$tokenizer")
  "$bin" bench --synthetic smollm3-3b --save-gguf "$model.part.gguf" "${with[@]}" &&
    mv "$model.part.gguf" "$model"
}

# Runs `cmd...` for phase `name` under the phase limit and records the outcome.
run_phase() {
  local name=$1; shift
  local log="$out/$name.log" start=$SECONDS rc
  # `timeout` runs programs, not shell functions: the phase's function (and gpu_tests, which
  # they call) run in a child bash that gets them, and the variables they read, exported.
  export -f gpu_tests
  # shellcheck disable=SC2163 # exports the function named by $1
  export -f "$1" 2>/dev/null || true
  timeout "$limit" bash -c '"$@"' _ "$@" >"$log" 2>&1
  rc=$?
  note_timeout $rc "$log"
  if [[ $rc -eq 0 ]]; then
    record "$name" passed $((SECONDS - start)) "$log"
  else
    record "$name" failed $((SECONDS - start)) "$log"
  fi
}

# Runs the shell function `fn` for phase `name` under the phase limit: its stdout is the
# phase's JSON result, its stderr the log. It reads the variables exported before.
run_json_phase() {
  local name=$1 fn=$2
  local log="$out/$name.log" start=$SECONDS result rc
  # shellcheck disable=SC2163 # exports the function named by $fn
  export -f "$fn" make_model gpu_tests
  result=$(timeout "$limit" bash -c "$fn" 2>"$log")
  rc=$?
  note_timeout $rc "$log"
  if [[ $rc -eq 0 ]]; then
    record "$name" passed $((SECONDS - start)) "$log" "$(python3 -c 'import json,sys; print(json.dumps(json.loads(sys.stdin.read())))' <<<"$result" 2>/dev/null || echo null)"
  else
    echo "$result" >>"$log"
    record "$name" failed $((SECONDS - start)) "$log"
  fi
}

skip() {
  local name=$1 why=$2
  echo "$why" >"$out/$name.log"
  record "$name" skipped 0 "$out/$name.log"
}

gpu_tests() {
  local t="$bundle/gpu-tests"
  [[ -x "$t" ]] || { echo "gpu-check: $t is missing (make gpu-bundle)" >&2; return 1; }
  SMOLTEST_ROOT=$repo "$t" --ignored --test-threads 1 --nocapture "$@"
}

# The binary and file the engine phases run: the bundle's on the 3B shape, or with --device cpu
# the tiny test file.
bin="$bundle/smolchat"
[[ -x "$bin" || -e "$bundle/smolchat.xz" ]] || bin=target/release/smolchat
if [[ "$device" == cuda* ]]; then model=$synth; else model=$repo/tests/data/smollm3-tiny-q8_0.gguf; fi
export bin model

case "$phase" in
  env)
    unpack
    python3 "$repo/scripts/gpu_check.py" env --out "$out" --bundle "$bundle" --device "$device" \
      --smi "${NVIDIA_SMI:-nvidia-smi}" || phase_failed=1
    ;;
  kernels)
    unpack
    run_phase kernels gpu_tests kernels_equal_their_twins kernels_quantizing_in_place_write_the_twins_q8_1_rows \
      matvec_kernels_equal_their_twin_bit_for_bit \
      graphs_replay_what_eager_computes \
      verifying_steps_draw_as_decoding_does_in_graphs cuda_qmatmul_matches_the_cpu_qmatrix \
      device_selection_sees_the_gpu
    ;;
  sanitizer)
    unpack
    if ! command -v compute-sanitizer >/dev/null; then
      skip sanitizer "compute-sanitizer is not installed on this machine"
    else
      sanitize() {
        SMOLTEST_ROOT=$repo compute-sanitizer --tool memcheck --error-exitcode 1 \
          "$bundle/gpu-tests" --ignored --test-threads 1 the_fast_tier_matches_llama_cpp_and_itself &&
        SMOLTEST_ROOT=$repo compute-sanitizer --tool racecheck --error-exitcode 1 \
          "$bundle/gpu-tests" --ignored --test-threads 1 the_self_check_passes_on_this_gpu
      }
      run_phase sanitizer sanitize
    fi
    ;;
  tiers)
    unpack
    run_phase tiers gpu_tests the_fast_tier_matches_llama_cpp_and_itself the_self_check_passes_on_this_gpu \
      hidden_states_for_embeddings_match_the_cpu_engine
    ;;
  http)
    unpack
    log="$out/http.log"; start=$SECONDS
    [[ -x "$bin" ]] || bin=target/debug/smolchat
    expect=(); [[ "$device" == cuda* ]] && expect=(--expect-tier fast)
    result=$(timeout "$limit" python3 scripts/gpu_http_check.py --bin "$bin" --device "$device" \
        --model tests/data/smollm3-tiny-q8_0.gguf "${expect[@]}" 2>"$log")
    rc=$?
    note_timeout $rc "$log"
    if [[ $rc -eq 0 ]]; then
      record http passed $((SECONDS - start)) "$log" "$result"
    else
      echo "$result" >>"$log"
      record http failed $((SECONDS - start)) "$log" "${result:-null}"
    fi
    ;;
  llama)
    if [[ -z "$tarball" || ! -f "$tarball" ]]; then
      skip llama "no llama.cpp tarball given (--tarball FILE; make llama-tarball builds one)"
    else
      # Built in the work folder, once per tarball: a later call on the same machine reuses it.
      build_llama() {
        local src="$work/llama.cpp" stamp
        stamp="$(basename "$tarball") $(stat -c '%s %Y' "$tarball")"
        if [[ -x "$src/build/bin/llama-bench" && -x "$src/build/bin/llama-batched-bench" &&
              "$(cat "$src/.tarball" 2>/dev/null)" == "$stamp" ]]; then
          echo "gpu-check: llama.cpp already built from $stamp in $src"
          return 0
        fi
        rm -rf "$src" && mkdir -p "$src" &&
        tar -xf "$tarball" -C "$src" --strip-components=1 &&
        cmake -S "$src" -B "$src/build" -DGGML_CUDA=ON \
          -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
          -DLLAMA_BUILD_SERVER=ON -DCMAKE_BUILD_TYPE=Release &&
        cmake --build "$src/build" -j "$(nproc)" --target llama-bench llama-batched-bench llama-lookup llama-server &&
        echo "$stamp" >"$src/.tarball"
      }
      run_phase llama build_llama
    fi
    ;;
  bench)
    unpack
    # The 3B shape as llama.cpp is measured on it; with --device cpu a dry run on the tiny file.
    if [[ "$device" == cuda* ]]; then
      p1=512 gen=64 nb=64 pb=32
    else
      p1=32 gen=4 nb=4 pb=8
    fi
    export p1 gen nb pb
    bench() {
      make_model >&2 || return 1
      echo '{'
      # The tier `auto` keeps on this file (the self-check's verdict), then the figures on the
      # fast tier: the file's random blocks make a 36-layer net whose two tiers drift apart
      # more than a trained model's do (on an H100 the self-check failed it by 2%).
      echo '"auto_tier": '; "$bin" bench --model "$model" --device "$device" --prompt-tokens 16 --gen-tokens 1 --batch 1 |
        python3 -c 'import json,sys; d=json.load(sys.stdin); print(json.dumps({"tier": d["tier"], "note": d["tier_note"]}))' || return 1
      export SMOLCHAT_MODEL__GPU_TIER=fast
      # Warm medians of 5 runs (llama-bench's repetitions), decode from an empty context as
      # llama-bench's tg and after the prompt; 64 sequences of 32-token prompts as
      # llama-batched-bench -npp 32 (the single-sequence part of that run once: unused).
      echo ', "smolchat_1": '; "$bin" bench --model "$model" --device "$device" --prompt-tokens "$p1" --gen-tokens "$gen" --batch 1 --repeat 5 || return 1
      echo ', "smolchat_64": '; "$bin" bench --model "$model" --device "$device" --prompt-tokens "$pb" --gen-tokens "$gen" --batch "$nb" --batch-prompt-tokens "$pb" --repeat 1 || return 1
      local lb="$work/llama.cpp/build/bin"
      if [[ -x "$lb/llama-bench" && "$device" == cuda* ]]; then
        echo ', "llama_bench": '; "$lb/llama-bench" -m "$model" -ngl 99 -p 512 -n 64 -o json || return 1
        echo ', "llama_batched_text": '
        "$lb/llama-batched-bench" -m "$model" -ngl 99 -c 16384 -npp 32 -ntg 64 -npl 1,8,32,64 2>&1 |
          python3 -c 'import json,sys; print(json.dumps(sys.stdin.read()[-4000:]))'
      fi
      echo '}'
    }
    run_json_phase bench bench
    ;;
  server)
    unpack
    # Through the server: time to first token and per-stream speed at 1/8/32/64 conversations
    # (with --device cpu: 1 and 2 on the tiny file, few tokens).
    if [[ "$device" == cuda* ]]; then clients=1,8,32,64 tokens=128; else clients=1,2 tokens=8; fi
    export clients tokens
    server() {
      make_model >&2 || return 1
      local conv v1 llama=null lb="$work/llama.cpp/build/bin"
      conv=$(python3 scripts/http_bench.py --binary "$bin" --model "$model" --device "$device" \
        --clients "$clients" --new-tokens "$tokens" --no-second-turn --env SMOLCHAT_MODEL__GPU_TIER=fast) || return 1
      # The same streams on /v1 and, when built, on llama-server: one client for both.
      v1=$(python3 scripts/openai_load.py --smolchat "$bin" --model "$model" --device "$device" \
        --clients "$clients" --new-tokens "$tokens" --env SMOLCHAT_MODEL__GPU_TIER=fast) || return 1
      if [[ -x "$lb/llama-server" && "$device" == cuda* ]]; then
        llama=$(python3 scripts/openai_load.py --llama-server "$lb/llama-server" --model "$model" \
          --ngl 99 --parallel 64 --clients "$clients" --new-tokens "$tokens") ||
          { echo "gpu-check: llama-server did not run through; ours stands" >&2; llama=null; }
      fi
      # One conversation again with every step waited for before the next is launched
      # (scheduler.async_steps = false): what launching the next step ahead gains.
      local sync=null
      sync=$(python3 scripts/http_bench.py --binary "$bin" --model "$model" --device "$device" \
        --clients 1 --new-tokens "$tokens" --no-second-turn --env SMOLCHAT_MODEL__GPU_TIER=fast \
        --env SMOLCHAT_SCHEDULER__ASYNC_STEPS=false) ||
        { echo "gpu-check: the server without async steps did not run through" >&2; sync=null; }
      python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d["v1"]=json.loads(sys.argv[2]); d["llama_server"]=json.loads(sys.argv[3]); d["sync_steps"]=json.loads(sys.argv[4]); print(json.dumps(d))' \
        "$conv" "$v1" "$llama" "$sync"
    }
    run_json_phase server server
    ;;
  profile)
    # Where a step's time goes on this GPU: our op-by-op profile of the 3B shape (a synchronize
    # after each op, so each carries its launch overhead), then Nsight Compute's per-kernel
    # tables of one decode step at depth 0 and at 512, ours (a graph replay: the kernels as
    # they really run) beside llama-bench's when the `llama` phase built it. Nsight Systems is
    # not looked for: the GPU machines lack it.
    unpack
    profile() {
      local ncu left
      gpu_tests fast_tier::profile_the_3b_shape >&2 || return 1
      ncu=$(command -v ncu)
      for c in /usr/local/cuda-*/bin/ncu /opt/nvidia/nsight-compute/*/ncu; do
        [[ -z "$ncu" && -x "$c" ]] && ncu=$c
      done
      if [[ -z "$ncu" ]]; then
        echo "gpu-check: ncu (Nsight Compute) is not installed here: no per-kernel profile" >&2
        echo '{"ncu": "absent: ncu (Nsight Compute) is not installed on this machine"}'
        return 0
      fi
      make_model >&2 || return 1
      # One decode step, ours and llama-bench's, at depth 0 and 512: ours is the step inside
      # the profiler range `bench --profile-decode-at` opens (a graph replay), llama-bench's
      # the last token of `-p 0 -n 1 -r 1` (its warm-up token and the measured one at depth
      # 0 make the launches per token: half of that run's).
      local depth ours theirs per_token=0 lb="$work/llama.cpp/build/bin" decode="{"
      local metrics=(--csv --page raw --metrics gpu__time_duration.sum --cache-control none --clock-control none)
      for depth in 0 512; do
        left=$((limit - SECONDS - 10))
        [[ $left -gt 10 ]] || { echo "gpu-check: no time left for ncu at depth $depth" >&2; break; }
        echo "gpu-check: ncu of one decode step of ours at depth $depth, within $left s" >&2
        SMOLCHAT_MODEL__GPU_TIER=fast timeout "$left" "$ncu" "${metrics[@]}" --profile-from-start off \
          "$bin" bench --model "$model" --device cuda --profile-decode-at "$depth" \
          >"$out/ncu-decode-$depth.csv" 2>&1
        ours=$(python3 "$repo/scripts/gpu_check.py" ncu-summary "$out/ncu-decode-$depth.csv" \
          "smolchat: one decode step at depth $depth (graph replay)") || {
          grep -E "^==(ERROR|WARNING)==" "$out/ncu-decode-$depth.csv" | head -5 >&2
          echo "gpu-check: ncu gave no per-kernel rows for our decode at depth $depth: $ours" >&2
          return 1
        }
        theirs=null
        left=$((limit - SECONDS - 5))
        if [[ -x "$lb/llama-bench" && $left -gt 20 ]]; then
          timeout "$left" "$ncu" "${metrics[@]}" \
            "$lb/llama-bench" -m "$model" -ngl 99 -p 0 -n 1 -d "$depth" -r 1 >"$out/ncu-llama-$depth.csv" 2>&1
          if [[ $depth == 0 ]]; then
            per_token=$(python3 "$repo/scripts/gpu_check.py" ncu-summary "$out/ncu-llama-0.csv" |
              python3 -c 'import json,sys; print(json.load(sys.stdin).get("launches", 0) // 2)') || per_token=0
          fi
          [[ $per_token -gt 0 ]] && theirs=$(python3 "$repo/scripts/gpu_check.py" ncu-summary \
            "$out/ncu-llama-$depth.csv" "llama-bench: one decode token at depth $depth" --tail "$per_token") ||
            theirs=null
        fi
        decode+="\"$depth\": {\"ours\": $ours, \"llama\": $theirs},"
      done
      decode="${decode%,}}"
      echo "{\"decode\": $decode}"
    }
    if [[ "$device" == cuda* ]]; then
      run_json_phase profile profile
    else
      skip profile "no GPU: the profile needs one (--device $device)"
    fi
    ;;
  speculation)
    unpack
    if [[ "$device" == cuda* ]]; then tokens=96; else tokens=12; fi
    export tokens
    speculation() {
      make_model >&2 || return 1
      SMOLCHAT_MODEL__GPU_TIER=fast "$bin" bench --speculative --model "$model" --device "$device" \
        --gen-tokens "$tokens" || return 1
      # llama.cpp's own lookup decoding on the same file and workloads, when the `llama` phase
      # built it: its figures go to <out>/llama_lookup.json, its lines to the log.
      local lb="$work/llama.cpp/build/bin"
      if [[ -x "$lb/llama-lookup" && "$device" == cuda* ]]; then
        python3 scripts/llama_lookup_bench.py --llama-bin "$lb" --model "$model" --ngl 99 \
          --max-tokens "$tokens" --draft 8 --repeat 1 --out "$out/llama_lookup.json" >&2 ||
          echo "gpu-check: llama-lookup did not run through (see above); smolchat's figures stand" >&2
      fi
    }
    run_json_phase speculation speculation
    ;;
  report)
    python3 "$repo/scripts/gpu_check.py" report "$out" || phase_failed=1
    ;;
  all)
    failed=()
    for p in env kernels sanitizer tiers http llama bench server speculation profile; do
      "$self" "$p" --bundle "$bundle" --out "$out" --work "$work" --device "$device" \
        ${tarball:+--tarball "$tarball"} || failed+=("$p")
    done
    # The report's first line says which phase failed and why.
    "$self" report --out "$out"
    if [[ ${#failed[@]} -gt 0 ]]; then
      echo "gpu-check: ${#failed[@]} phase(s) failed: ${failed[*]}" >&2
      exit 1
    fi
    ;;
  lease)
    # One call for one GPU lease (see the top of this file). Phases in priority order with
    # their estimated seconds: measured on an H100 and an H200 (docs/BENCHMARKS.md, "GPU"):
    # kernels 65-74 s, sanitizer 38-56 s, bench and server together 20-24 s, llama.cpp's build
    # 241-302 s; the rest guessed with room. A phase is skipped when the budget left is below
    # its estimate, and runs under `timeout` of the budget left.
    lease_plan=(env:15 kernels:90)
    [[ -n "$with_llama" ]] && lease_plan+=(llama:330)
    lease_plan+=(bench:60 tiers:60 profile:90 server:120 http:30 sanitizer:75)
    lease_dir="$work/lease"
    records="$lease_dir/records"
    state="$lease_dir/state.json"
    rm -rf "$lease_dir"
    mkdir -p "$records"
    py() { python3 "$repo/scripts/gpu_check.py" "$@"; }
    # Sends TERM to a process and everything below it, children first listed then ended.
    kill_tree() {
      local c
      for c in $(ps -o pid= --ppid "$1" 2>/dev/null); do kill_tree "$c"; done
      kill -TERM "$1" 2>/dev/null
    }
    start=$SECONDS
    echo "gpu-lease: budget $budget s, device $device, bundle $bundle, out $out (report and raw.tar.xz only), work $work" >&2
    py lease-init "$state" --budget "$budget" --device "$device" --out "$out" --bundle "$bundle" \
      --records "$records" --card "$card" --anchors "$repo/docs/bench-data/gpu-anchors.json" \
      --with-llama "${with_llama:-0}" "${lease_plan[@]/:/=}" || exit 2
    for item in "${lease_plan[@]}"; do
      p=${item%%:*}
      left=$((budget - (SECONDS - start)))
      why=$(py lease-gate "$state" "$p" "$left")
      if [[ -n "$why" ]]; then
        py lease-skip "$state" "$p" "$why"
        continue
      fi
      py lease-start "$state" "$p" "$left"
      t0=$SECONDS
      # The phase's own limit ends its command a little before the budget does, so its record
      # and log are written; `timeout` of the budget left is the backstop.
      GPU_CHECK_LIMIT=$((left > 15 ? left - 5 : left)) timeout -k 5 "$left" "$self" "$p" --out "$records" \
        --bundle "$bundle" --work "$work" --device "$device" ${tarball:+--tarball "$tarball"} \
        >>"$records/lease.log" 2>&1 &
      child=$!
      # Killed itself (the command's own time limit), the lease ends the phase's processes, the
      # timeouts' process groups included, and leaves the report as it stands: "CUT OFF during".
      trap 'kill_tree "$child"; exit 143' TERM INT HUP
      wait "$child"
      rc=$?
      trap - TERM INT HUP
      py lease-done "$state" "$p" "$rc" $((SECONDS - t0))
    done
    py lease-finish "$state"
    exit $?
    ;;
  *)
    sed -n '2,59p' "$0"
    exit 2
    ;;
esac
exit "$phase_failed"
