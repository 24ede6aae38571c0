#!/usr/bin/env bash
# The GPU check: GPU tests, every notebook under nbval on CUDA (executed copies saved so the
# book shows GPU outputs), and the benchmarks; prints one summary table last.
#
# Where: a CUDA machine with torch, triton and transformers. If the Jupyter/nbval stack, the
# server stack or xgrammar is missing, put their wheels (nbval, ipykernel, fastapi, uvicorn,
# openai, xgrammar, apache-tvm-ffi, jsonschema and dependencies) in .whl/: they are installed
# to /tmp/site first. Results land in $OUT
# (default: .out/gpu) and in benchmarks/.
#   bash scripts/gpu_check.sh [tests] [notebooks] [bench]   (default: all three)
#   BENCHES="moe latency" bash scripts/gpu_check.sh bench    (a subset of the benchmarks)
#   TESTS="tests/test_gpu_qwen3_5.py" bash scripts/gpu_check.sh tests   (a subset of the GPU tests)
#   TESTS=kernels bash scripts/gpu_check.sh tests, then TESTS=engine, then TESTS=marked (the
#     gpu-marked tests of the other files): the list in parts (on an H100 the kernel files
#     alone ran past 330 s: the whole list needs more than one call)
#   NOTEBOOKS="notebooks/02_*.ipynb" bash scripts/gpu_check.sh notebooks
# The whole check takes longer than one 10-minute call on a fresh machine (the GPU tests
# alone about 10 minutes, most of it transformers' float32 references and Triton compiling):
# run it in parts. Logs are packed into $OUT/logs.tgz at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.out/gpu}
mkdir -p "$OUT" benchmarks
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ] && ! python3 -c 'import nbval, xgrammar, jsonschema' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site" PATH="/tmp/site/bin:$PATH"
fi
parts=${*:-tests notebooks bench}
declare -A status
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/gpu.txt"

# Tensor parallelism (chapter 16) needs two GPUs: its GPU test and benchmark run only then.
# NVLink multicast (NVLS) stays off: not every host's fabric allows it.
multi_gpu=$([ "$(nvidia-smi -L | wc -l)" -ge 2 ] && echo yes || echo no)
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
tp_tests=$([ $multi_gpu = yes ] && echo "tests/test_tensor_parallel.py::test_bf16_tensor_parallel_matches_one_gpu")
if [[ $parts == *tests* ]]; then
  kernel_tests="tests/test_kernels.py tests/test_flash_decode.py tests/test_fp8_kv_cache.py tests/test_fp8_linear.py tests/test_kv_scales.py tests/test_kernels_gated_delta.py tests/test_kernels_token_bitmask.py tests/test_kernels_sampling.py"
  engine_tests="tests/test_gpu_engine.py tests/test_structured_output.py tests/test_grammar_compile.py $(ls tests/test_gpu_*.py 2>/dev/null | grep -v test_gpu_engine.py) $tp_tests"
  # Every other file with tests marked gpu: only those tests (-m gpu), the file's CPU tests
  # being the CPU suite's.
  marked=$(grep -l "pytest.mark.gpu" tests/test_*.py | grep -v -x -F "$(printf '%s\n' $kernel_tests $engine_tests tests/test_tensor_parallel.py)")
  # A test stuck for over 5 minutes dumps every thread's stack into the log; with
  # pytest-timeout installed, one stuck for 10 minutes (say, in an NCCL collective, where no
  # signal reaches Python) also ends the run instead of holding the machine.
  stuck=$(python3 -c 'import pytest_timeout' 2>/dev/null && echo "--timeout=600 --timeout-method=thread")
  run_tests() {
    python3 -m pytest -q -p no:cacheprovider -rfE --durations=10 -o faulthandler_timeout=300 $stuck "$@" \
      2>&1 | tee -a "$OUT/tests.log"
    return "${PIPESTATUS[0]}"
  }
  : > "$OUT/tests.log"
  ok=pass
  case ${TESTS:-all} in
    kernels) run_tests $kernel_tests || ok=FAIL ;;
    engine) run_tests $engine_tests || ok=FAIL ;;
    marked) run_tests -m gpu $marked || ok=FAIL ;;
    all) run_tests $kernel_tests $engine_tests || ok=FAIL; run_tests -m gpu $marked || ok=FAIL ;;
    *) run_tests $TESTS || ok=FAIL ;;
  esac
  status[tests]=$ok
fi
# Benchmarks first: chapters 09, 10 and 15 read their JSON.
if [[ $parts == *bench* ]]; then
  ok=pass
  benches="${BENCHES:-kernels flash latency throughput throughput-fp8kv throughput-fp8 latency-fp8 moe gated-delta serving structured spec} $([ $multi_gpu = yes ] && echo tp)"
  for which in $benches; do
    if [ $which = structured ]; then  # chapter 18: a script of its own
      command="python3 scripts/bench_structured.py --out benchmarks/structured.json"
    elif [ $which = flash ]; then  # chapter 09: the two-stage kernel against the tuned one
      command="python3 scripts/bench_flash_decode.py --out benchmarks"
    elif [ $which = throughput-fp8kv ]; then  # chapter 20: the fp8 KV cache (throughput_kv_fp8.json)
      command="python3 -m minivllm.cli bench throughput --no-transformers --kv-cache-dtype fp8 --out benchmarks"
    elif [ $which = throughput-fp8 ]; then  # chapter 20: fp8 KV cache and weights (throughput_kv_fp8_w_fp8.json)
      command="python3 -m minivllm.cli bench throughput --no-transformers --kv-cache-dtype fp8 -q fp8 --out benchmarks"
    elif [ $which = latency-fp8 ]; then  # chapter 20: batch-1 decode on fp8 weights (latency_w_fp8.json)
      command="python3 -m minivllm.cli bench latency -q fp8 --out benchmarks"
    elif [ $which = spec ]; then  # chapter 19: n-gram and draft-model speculation on the bundled model
      command="python3 scripts/bench_spec.py --device cuda --out benchmarks/spec_decode.json"
    else
      command="python3 -m minivllm.cli bench $which --out benchmarks"
    fi
    $command > "$OUT/bench_$which.log" 2>&1 || { ok=FAIL; tail -20 "$OUT/bench_$which.log"; }
  done
  tar czf "$OUT/benchmarks.tgz" benchmarks/*.json benchmarks/*.png 2>/dev/null
  status[bench]=$ok
fi
if [[ $parts == *notebooks* ]]; then
  # Execute in place (the committed copies then carry GPU outputs), then nbval over them.
  notebooks=${NOTEBOOKS:-notebooks/[0-9]*.ipynb}
  python3 scripts/execute_notebooks.py $notebooks 2>&1 | tee "$OUT/notebooks.log"
  ok=$([ "${PIPESTATUS[0]}" = 0 ] && echo pass || echo FAIL)
  tar czf "$OUT/notebooks.tgz" $notebooks
  if [ "${NBVAL:-1}" = 1 ]; then
    python3 -m pytest -q -p no:cacheprovider --nbval-lax --nbval-current-env \
      --nbval-sanitize-with notebooks/sanitize.cfg $notebooks 2>&1 | tee -a "$OUT/notebooks.log"
    [ "${PIPESTATUS[0]}" = 0 ] || ok=FAIL
  fi
  status[notebooks]=$ok
fi

python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
rows = []
def load(name):
    p = os.path.join("benchmarks", name)
    return json.load(open(p)) if os.path.exists(p) else None
k, l, t, m, sv, gd = (load(f"{name}.json") for name in ("kernels", "latency", "throughput", "moe", "serving", "gated_delta"))
if gd:
    for c in gd["chunked_prefill"]:
        rows.append((f"gated delta prefill {'+'.join(map(str, c['prompt_lens']))}", f"{c['triton_seconds']*1e6:.0f} us",
                     f"x{c['speedup']:.1f} vs torch"))
    for c in gd["recurrent_decode"]:
        rows.append((f"gated delta decode b={c['batch']}", f"{c['triton_seconds']*1e6:.0f} us",
                     f"{c['percent_of_copy_bandwidth']:.0f}% of copy BW"))
if k:
    for c in k["paged_decode_attention"]:
        rows.append((f"paged decode attn b={c['batch']} ctx={c['context']}", f"{c['seconds']*1e6:.0f} us",
                     f"{c['percent_of_copy_bandwidth']:.0f}% of copy BW"))
if l:
    rows.append(("batch-1 decode, CUDA graphs", f"{l['cuda_graphs']['decode_tokens_per_s']:.0f} tok/s",
                 f"{l['percent_of_speed_of_light_with_graphs']:.0f}% of SOL"))
    rows.append(("batch-1 decode, eager", f"{l['eager']['decode_tokens_per_s']:.0f} tok/s", f"graphs x{l['graph_speedup']:.2f}"))
    for n, s in l["cuda_graphs"]["ttft_seconds"].items():
        rows.append((f"TTFT {n}-token prompt", f"{s*1e3:.1f} ms", ""))
if t:
    ours = t["minivllm"]
    rows.append(("throughput (256 req)", f"{ours['output_tokens_per_s']:.0f} tok/s", f"{ours['percent_of_speed_of_light']:.0f}% of SOL"))
    tr = t.get("transformers") or {}
    for key in ("generate_batch", "padded_generate"):
        r = tr.get(key, {})
        rows.append((f"transformers {key}", f"{r['output_tokens_per_s']:.0f} tok/s" if "output_tokens_per_s" in r else r.get("error", "-")[:60], ""))
    c = t["ceilings"]
    rows.append(("ceilings", f"{c['copy_bandwidth_bytes_per_s']/1e12:.2f} TB/s copy", f"{c['bf16_matmul_flops_per_s']/1e12:.0f} TFLOP/s bf16"))
if m:
    for c in m["moe_layer"]:
        rows.append((f"MoE layer {c['tokens']} tokens, fused", f"{c['fused_seconds']*1e6:.0f} us",
                     f"x{c['speedup']:.1f} vs loop, {c['fused_percent_of_floor']:.0f}% SOL"))
    for name, r in m["engine"]["runs"].items():
        rows.append((f"MoE 4-layer throughput, {name}", f"{r['output_tokens_per_s']:.0f} tok/s", ""))
if sv:
    for r in sv["online"]:
        rows.append((f"serving rate {r['rate']}/s", f"TTFT p50 {r['ttft_s']['p50']*1e3:.0f} ms p99 {r['ttft_s']['p99']*1e3:.0f}",
                     f"ITL p50 {r['itl_s']['p50']*1e3:.1f} ms, {r['output_tokens_per_s']:.0f} tok/s"))
    rows.append(("serving workload offline", f"{sv['offline']['output_tokens_per_s']:.0f} tok/s", ""))
print("\n=== GPU check summary ===")
for r in rows:
    print(f"{r[0]:<40} {r[1]:>22} {r[2]:>22}")
PY
for part in "${!status[@]}"; do echo "$part: ${status[$part]}"; done
# One archive of the logs, beside the benchmark and notebook archives.
(cd "$OUT" && tar czf logs.tgz *.log gpu.txt && rm -f *.log gpu.txt)
for part in "${!status[@]}"; do [ "${status[$part]}" = pass ] || exit 1; done
