#!/usr/bin/env bash
# The GPU check of issue #33, prepared in advance: on a machine with a CUDA device, run the Triton kernel tests on CUDA
# and the decode benchmark, and write everything under OUT_DIR (7 files: device.txt, gpu_decode.txt/.json,
# test_triton_kernels.txt/.xml, test_cuda.txt, acceptance.txt: the issue's bars, also the output's last lines). Bounded by its timeouts to 8 minutes (benchmark <= 180 s,
# kernel tests and the vLLM plugin's Triton paths <= 170 s, library tests on CUDA <= 130 s; BENCH_S, TESTS_S and
# CUDA_TESTS_S override them). On the H200 of session 46: benchmark ~90 s, kernel tests 122 s, tests/test_cuda.py
# 119 s: about 6 minutes (since then the benchmark times key tiles too, and last, after its other rows, the vLLM
# plugin's decode at 32k x 16; the plugin's Triton tests run with the kernels': not yet timed; session 58 counted 210 distinct kernel specializations among those tests' launches under
# the interpreter, 131 of them decode kernels: about that many compiles, spread over the workers).
#
#   benchmarks/gpu_check.sh [OUT_DIR]          # default: $OUT, else out/gpu_check
#   PYTHON=/path/to/python benchmarks/gpu_check.sh
#   PEAK_TBPS=4.8 benchmarks/gpu_check.sh      # override the device's peak bandwidth
#
# The sweep runs at Llama-3-8B's heads (d 128). Where device time is left, SmolLM2's shape (d 64, 9/3 heads), whose
# register and pipeline choices differ (docs/reference/performance.md, session 58), in a second call:
#   PYTHONPATH=src python benchmarks/gpu_decode.py --out "$OUT/d64" --head-dim 64 --q-heads 9 --kv-heads 3 \
#       --sweep 32768x16 --contexts 32768 --batches 16 --e2e-contexts ""
#
# Nothing is installed from the network (the lent GPU machines reach none): the package runs from src/ and uses the
# machine's torch, triton, transformers and pytest. Wheels in .whl/ (for a version the machine lacks) are installed
# into a private folder first, without dependencies. The lent H200's image had transformers 5.17, older than the
# version wushkv requires (pyproject.toml; the whole-model tests and the end-to-end rows need it: with 5.17 the decode
# step never reaches the kernels); carry it, from this machine's repository root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl transformers==5.24.0
# then run `bash benchmarks/gpu_check.sh "$OUT"` with `.whl` carried. device.txt says which versions ran.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-out/gpu_check}}"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
mkdir -p "$OUT_DIR"
unset TRITON_INTERPRET  # compiled kernels: the interpreter is for CPU-only machines
export PYTHONUNBUFFERED=1
status=0

# 1. the environment: carried wheels, then the package from src/ (first on the path)
if compgen -G ".whl/*.whl" > /dev/null; then
    SITE="${TMPDIR:-/tmp}/wushkv-gpu-site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || status=1
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'EOF' 2>&1 | tee "$OUT_DIR/device.txt"
import sys, tomllib
import torch
if not torch.cuda.is_available():
    print("no CUDA device")
    sys.exit(2)
import transformers, triton
from packaging.requirements import Requirement
print("device", torch.cuda.get_device_name(), "| torch", torch.__version__, "| triton", triton.__version__,
      "| transformers", transformers.__version__, "| python", sys.version.split()[0])
deps = [Requirement(r) for r in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]]
want = next(r for r in deps if r.name == "transformers")
if transformers.__version__ not in want.specifier:
    print(f"WARNING: transformers {transformers.__version__} is not {want}: carry the wheel (see the script's header); "
          "the whole-model tests and the end-to-end rows will fail")
    sys.exit(1)
import wushkv.cache, wushkv.triton_kernels  # noqa: F401  (the package imports from src/)
EOF
case "${PIPESTATUS[0]}" in 0) ;; 2) exit 2 ;; *) status=1 ;; esac

# 2. the decode benchmark first (the figures the issue asks for): the tuning sweep, kernel-level rows and end to end,
#    JSON in OUT_DIR/gpu_decode.json (rewritten after every row, so a run cut short by the timeout keeps what it measured)
timeout "${BENCH_S:-180}" "$PY" benchmarks/gpu_decode.py --out "$OUT_DIR" ${PEAK_TBPS:+--peak-tbps "$PEAK_TBPS"} \
    2>&1 | tee "$OUT_DIR/gpu_decode.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# 3. the kernel tests on CUDA: tests/test_triton_kernels.py runs its tensors on the GPU where CUDA is present (its
#    compile-without-a-GPU test is for machines without one), and so do the vLLM plugin's Triton paths (its cells
#    decoded and stored by the kernels; vLLM itself is not needed). pytest-xdist spreads the kernels' compiles over cores.
EXTRA=()
"$PY" -c "import xdist" 2>/dev/null && EXTRA+=(-n 8)
"$PY" -c "import pytest_timeout" 2>/dev/null && EXTRA+=(--timeout 170)
timeout "${TESTS_S:-170}" "$PY" -m pytest -q -p no:cacheprovider --durations 15 ${EXTRA[@]+"${EXTRA[@]}"} tests/test_triton_kernels.py \
    --deselect tests/test_triton_kernels.py::test_kernels_compile_for_cuda --junitxml "$OUT_DIR/test_triton_kernels.xml" \
    tests/test_vllm_plugin.py -k "not test_vllm_plugin.py or triton" \
    2>&1 | tee "$OUT_DIR/test_triton_kernels.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# 4. the whole library on CUDA against CPU (tests/test_cuda.py), in what time is left
timeout "${CUDA_TESTS_S:-130}" "$PY" -m pytest -q -p no:cacheprovider --durations 15 ${EXTRA[@]+"${EXTRA[@]}"} tests/test_cuda.py \
    2>&1 | tee "$OUT_DIR/test_cuda.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# 5. what to read first, at the end of the output: the issue's bars off the benchmark's rows (a run cut short by its
#    timeout included) and each test run's last line
[ -f "$OUT_DIR/gpu_decode.json" ] && "$PY" benchmarks/gpu_decode.py --plot-from "$OUT_DIR/gpu_decode.json" 2>&1 \
    | tee "$OUT_DIR/acceptance.txt"
for f in test_triton_kernels test_cuda; do
    [ -f "$OUT_DIR/$f.txt" ] && echo "$f: $(tail -n 1 "$OUT_DIR/$f.txt")"
done
echo "gpu_check: status $status in ${SECONDS}s, results in $OUT_DIR"
exit $status
