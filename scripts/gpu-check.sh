#!/usr/bin/env bash
# `make gpu-check`: what only a GPU can prove about the CUDA tiers, in phases that each finish
# within 10 minutes, run on a machine with a GPU and the CUDA 13 libraries from the bundle
# `make gpu-bundle` builds (see README, "GPU build and gpu-check"). No cargo, no network needed.
#
#   scripts/gpu-check.sh PHASE [options]      PHASE: env kernels sanitizer tiers http llama bench
#                                             speculation profile report all
#
#   --bundle DIR     where the bundle's files are (default target/gpu-bundle)
#   --out DIR        where results go (default $OUT when set, else target/gpu-check)
#   --tarball FILE   llama.cpp source tarball for the `llama` phase (b9793, `make llama-tarball`)
#   --device D       device for the http/bench/speculation phases (default cuda; `cpu` dry-runs them)
#
# Each phase writes <out>/<phase>.json ({"phase", "status": passed|failed|skipped, "seconds",
# "detail", ...}) and its log; `report` gathers them into <out>/gpu-check.json and a short
# <out>/gpu-check.md. Phases:
#   env        the GPU, driver and libraries (nvidia-smi, ldd of the binaries)
#   kernels    every kernel of ours against its Rust twin, op by op over many step shapes (sampling
#              included); decode graphs replaying what eager steps compute; candle's CUDA
#              quantized matmul against the CPU; device selection (tests/gpu.rs)
#   sanitizer  compute-sanitizer memcheck and racecheck over the kernel test (when installed)
#   tiers      the fast tier against llama.cpp's logits and itself (batched = alone), the start-up
#              self-check keeping the fast tier
#   http       the server with --device cuda: a conversation streamed over SSE and stored, /v1
#              whole and streamed, /metrics naming the device and tier (scripts/gpu_http_check.py)
#   llama      builds llama.cpp's llama-bench and llama-batched-bench with CUDA from --tarball
#   bench      `smolchat bench --device cuda` on the SmolLM3-3B shape beside llama.cpp's figures,
#              and the server at 1/8/32/64 concurrent conversations (scripts/http_bench.py)
#   profile    where a step's time goes: the op-by-op profile of the 3B shape, and Nsight Systems'
#              kernel tables of `smolchat bench` and llama-bench when nsys is installed
#   speculation `smolchat bench --speculative` on the fast tier: the three workloads and the chat
#              (beside llama.cpp's `llama-lookup` on the same workloads when `llama` built it)
#              series, drafts off and on (verified inside decode graphs, drawn on the GPU), on the
#              SmolLM3-3B shape (with --device cpu: the tiny test file, few tokens)
set -uo pipefail

phase=${1:-}
shift || true
bundle=target/gpu-bundle
out=${OUT:-target/gpu-check}
tarball=
device=cuda
while [[ $# -gt 0 ]]; do
  case "$1" in
    --bundle) bundle=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --tarball) tarball=$2; shift 2 ;;
    --device) device=$2; shift 2 ;;
    *) echo "gpu-check: unknown option $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"

# The CUDA 13 libraries: the GPU machine's PyTorch environment holds them.
if [[ -z "${LD_LIBRARY_PATH:-}" ]]; then
  for d in /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib; do
    [[ -d "$d" ]] && export LD_LIBRARY_PATH=$d
  done
fi

# compute-sanitizer ships with the toolkit, outside PATH on some machines.
export PATH=$PATH:/usr/local/cuda/bin:/usr/local/cuda/compute-sanitizer

# Unpacks the bundle's compressed binaries once.
unpack() {
  for f in "$bundle"/*.xz; do
    [[ -e "$f" ]] || continue
    local bin=${f%.xz}
    [[ -x "$bin" && "$bin" -nt "$f" ]] || { xz -dkf "$f" && chmod +x "$bin"; }
  done
}

# Writes <out>/<phase>.json: phase, status, seconds, detail (the log's last lines), extra JSON.
record() {
  local name=$1 status=$2 seconds=$3 log=$4 extra=${5:-null}
  python3 - "$out/$name.json" "$name" "$status" "$seconds" "$log" "$extra" <<'PY'
import json, sys
path, name, status, seconds, log, extra = sys.argv[1:]
try:
    tail = open(log, errors="replace").read()[-6000:]
except OSError:
    tail = ""
rec = {"phase": name, "status": status, "seconds": float(seconds), "detail": tail}
if extra != "null":
    rec["result"] = json.loads(extra)
json.dump(rec, open(path, "w"), indent=2)
print(f"gpu-check {name}: {status} ({seconds} s)")
PY
}

# Runs `cmd...` for phase `name` under a 570 s limit and records the outcome.
run_phase() {
  local name=$1; shift
  local log="$out/$name.log" start=$SECONDS
  # `timeout` runs programs, not shell functions: the phase's function (and gpu_tests, which
  # they call) run in a child bash that gets them, and the variables they read, exported.
  export -f gpu_tests
  export -f "$1" 2>/dev/null || true
  export bundle repo out tarball
  if timeout 570 bash -c '"$@"' _ "$@" >"$log" 2>&1; then
    record "$name" passed $((SECONDS - start)) "$log"
  else
    record "$name" failed $((SECONDS - start)) "$log"
  fi
}

# Runs the shell function `fn` for phase `name` under a 570 s limit: its stdout is the phase's
# JSON result, its stderr the log. It reads bin, model, device, out and tokens.
run_json_phase() {
  local name=$1 fn=$2
  local log="$out/$name.log" start=$SECONDS result
  export -f "$fn"
  export bin model device out tokens
  if result=$(timeout 570 bash -c "$fn" 2>"$log"); then
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

case "$phase" in
  env)
    unpack
    {
      nvidia-smi || true
      echo; ldd "$bundle/smolchat" | grep -E "not found|cuda|cublas" || true
      echo; "$bundle/smolchat" --version || true
    } >"$out/env.log" 2>&1
    if nvidia-smi -L >/dev/null 2>&1 && ! ldd "$bundle/smolchat" | grep -q "not found"; then
      record env passed 0 "$out/env.log"
    else
      record env failed 0 "$out/env.log"
    fi
    ;;
  kernels)
    unpack
    run_phase kernels gpu_tests kernels_equal_their_twins kernels_quantizing_in_place_write_the_twins_q8_1_rows \
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
    bin="$bundle/smolchat"
    [[ -x "$bin" ]] || bin=target/debug/smolchat
    expect=(); [[ "$device" == cuda* ]] && expect=(--expect-tier fast)
    if result=$(timeout 570 python3 scripts/gpu_http_check.py --bin "$bin" --device "$device" \
        --model tests/data/smollm3-tiny-q8_0.gguf "${expect[@]}" 2>"$log"); then
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
      build_llama() {
        rm -rf "$out/llama.cpp" && mkdir -p "$out/llama.cpp" &&
        tar -xf "$tarball" -C "$out/llama.cpp" --strip-components=1 &&
        cmake -S "$out/llama.cpp" -B "$out/llama.cpp/build" -DGGML_CUDA=ON \
          -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
          -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release &&
        cmake --build "$out/llama.cpp/build" -j "$(nproc)" --target llama-bench llama-batched-bench llama-lookup
      }
      run_phase llama build_llama
    fi
    ;;
  bench)
    unpack
    bin="$bundle/smolchat"
    [[ -x "$bin" ]] || bin=target/release/smolchat
    model="$out/smollm3-3b-synth.gguf"
    bench() {
      [[ -f "$model" ]] || "$bin" bench --synthetic smollm3-3b --save-gguf "$model" || return 1
      echo '{'
      # The tier `auto` keeps on this file (the self-check's verdict), then the figures on the
      # fast tier: the file's random blocks make a 36-layer net whose two tiers drift apart
      # more than a trained model's do (on an H100 the self-check failed it by 2%).
      echo '"auto_tier": '; "$bin" bench --model "$model" --device "$device" --prompt-tokens 16 --gen-tokens 1 --batch 1 |
        python3 -c 'import json,sys; d=json.load(sys.stdin); print(json.dumps({"tier": d["tier"], "note": d["tier_note"]}))' || return 1
      export SMOLCHAT_MODEL__GPU_TIER=fast
      echo ', "smolchat_1": '; "$bin" bench --model "$model" --device "$device" --prompt-tokens 512 --gen-tokens 64 --batch 1 || return 1
      echo ', "smolchat_64": '; "$bin" bench --model "$model" --device "$device" --prompt-tokens 32 --gen-tokens 64 --batch 64 || return 1
      # Through the server: time to first token and per-stream speed at 1/8/32/64 conversations.
      echo ', "server": '; python3 scripts/http_bench.py --binary "$bin" --model "$model" --device "$device" \
        --clients 1,8,32,64 --no-second-turn --env SMOLCHAT_MODEL__GPU_TIER=fast || return 1
      local lb="$out/llama.cpp/build/bin"
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
  profile)
    # Where a step's time goes on this GPU: our op-by-op profile of the 3B shape (a synchronize
    # after each op, so each carries its launch overhead), then, when Nsight Systems is
    # installed, its kernel table for `smolchat bench` on the fast tier (decode replayed from
    # graphs: the kernels as they really run), and the same for llama.cpp's llama-bench when
    # the `llama` phase built it.
    unpack
    profile() {
      gpu_tests fast_tier::profile_the_3b_shape || return 1
      local nsys; nsys=$(command -v nsys || ls /opt/nvidia/nsight-systems/*/bin/nsys \
        /usr/local/cuda/nsight-systems-*/bin/nsys 2>/dev/null | head -1)
      if [[ -z "$nsys" ]]; then
        echo "gpu-check: nsys is not installed here; the op-by-op profile above is all"
        return 0
      fi
      local model="$out/smollm3-3b-synth.gguf"
      [[ -f "$model" ]] || "$bundle/smolchat" bench --synthetic smollm3-3b --save-gguf "$model" || return 1
      SMOLCHAT_MODEL__GPU_TIER=fast "$nsys" profile --force-overwrite true -o "$out/nsys-smolchat" \
        --stats=true "$bundle/smolchat" bench --model "$model" --device cuda --prompt-tokens 512 \
        --gen-tokens 64 --batch 1 || return 1
      local lb="$out/llama.cpp/build/bin"
      if [[ -x "$lb/llama-bench" ]]; then
        "$nsys" profile --force-overwrite true -o "$out/nsys-llama" --stats=true \
          "$lb/llama-bench" -m "$model" -ngl 99 -p 512 -n 64 -r 1 || return 1
      fi
      rm -f "$out"/nsys-*.nsys-rep "$out"/nsys-*.sqlite
    }
    if [[ "$device" == cuda* ]]; then
      run_phase profile profile
    else
      skip profile "the profile needs a GPU"
    fi
    ;;
  speculation)
    unpack
    bin="$bundle/smolchat"
    [[ -x "$bin" ]] || bin=target/release/smolchat
    if [[ "$device" == cuda* ]]; then
      model="$out/smollm3-3b-synth.gguf"; tokens=96
    else
      model=tests/data/smollm3-tiny-q8_0.gguf; tokens=12
    fi
    speculation() {
      [[ -f "$model" ]] || "$bin" bench --synthetic smollm3-3b --save-gguf "$model" || return 1
      SMOLCHAT_MODEL__GPU_TIER=fast "$bin" bench --speculative --model "$model" --device "$device" \
        --gen-tokens "$tokens" || return 1
      # llama.cpp's own lookup decoding on the same file and workloads, when the `llama` phase
      # built it: its figures go to <out>/llama_lookup.json, its lines to the log.
      local lb="$out/llama.cpp/build/bin"
      if [[ -x "$lb/llama-lookup" && "$device" == cuda* ]]; then
        python3 scripts/llama_lookup_bench.py --llama-bin "$lb" --model "$model" --ngl 99 \
          --max-tokens "$tokens" --draft 8 --repeat 1 --out "$out/llama_lookup.json" >&2 ||
          echo "gpu-check: llama-lookup did not run through (see above); smolchat's figures stand" >&2
      fi
    }
    run_json_phase speculation speculation
    ;;
  report)
    python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
phases = ["env", "kernels", "sanitizer", "tiers", "http", "llama", "bench", "speculation", "profile"]
recs = []
for p in phases:
    path = os.path.join(out, p + ".json")
    recs.append(json.load(open(path)) if os.path.exists(path) else {"phase": p, "status": "not run", "seconds": 0})
report = {"phases": recs, "passed": all(r["status"] in ("passed", "skipped") for r in recs)}
json.dump(report, open(os.path.join(out, "gpu-check.json"), "w"), indent=2)
lines = ["# gpu-check", "", "| phase | status | seconds |", "|---|---|---:|"]
lines += [f"| {r['phase']} | {r['status']} | {r['seconds']:.0f} |" for r in recs]
bench = next((r.get("result") for r in recs if r["phase"] == "bench" and r.get("result")), None)
if bench:
    def tps(b, k):
        try:
            return f"{b[k]['tokens_per_s']:.1f}"
        except (KeyError, TypeError):
            return "?"
    s1, s64 = bench.get("smolchat_1", {}), bench.get("smolchat_64", {})
    lines += ["", f"smolchat ({s1.get('device')}, {s1.get('tier')} tier): prefill 512 {tps(s1, 'prefill')} tok/s, "
              f"decode {tps(s1, 'decode')} tok/s, 64 sequences "
              f"{s64.get('batched_decode', {}).get('aggregate_tokens_per_s', 0):.1f} tok/s in all"]
    auto = bench.get("auto_tier") or {}
    lines += [f"`auto` kept the {auto.get('tier')} tier on this file" + (f" ({auto['note']})" if auto.get("note") else "")]
    server = (bench.get("server") or {}).get("concurrency") or []
    if server:
        lines += ["", "| conversations | aggregate tok/s | per stream tok/s | median TTFT ms |", "|---:|---:|---:|---:|"]
        lines += [f"| {r['clients']} | {r['aggregate_tokens_per_s']} | {r['per_stream_tokens_per_s']} | {r['ttft_ms_median']} |" for r in server]
spec = next((r.get("result") for r in recs if r["phase"] == "speculation" and r.get("result")), None)
if spec:
    lines += ["", f"Speculative decoding ({spec.get('device')}, greedy, one sequence):", "",
              "| workload | tok/s off | tok/s on | ratio | accepted / drafted | same tokens |",
              "|---|---:|---:|---:|---:|---|"]
    lines += [f"| {r['workload']} | {r['decode_tokens_per_s_off']:.1f} | {r['decode_tokens_per_s_on']:.1f} | "
              f"{r['ratio']:.2f} | {r['accepted']} / {r['drafted']} | {r['same_tokens']} |"
              for r in spec.get("speculative", [])]
    series = spec.get("chat_series") or {}
    runs = series.get("runs") or []
    if runs:
        lines += ["", "Chat series: " + ", ".join(f"{r['drafts']} {r['decode_tokens_per_s']:.1f} tok/s" for r in runs)
                  + f" (same tokens: {series.get('same_tokens')})"]
open(os.path.join(out, "gpu-check.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
    ;;
  all)
    for p in env kernels sanitizer tiers http llama bench speculation profile; do
      "$0" "$p" --bundle "$bundle" --out "$out" --device "$device" ${tarball:+--tarball "$tarball"}
    done
    "$0" report --out "$out"
    ;;
  *)
    sed -n '2,30p' "$0"
    exit 2
    ;;
esac
