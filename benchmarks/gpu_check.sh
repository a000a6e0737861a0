#!/usr/bin/env bash
# The GPU check of issue #33, prepared in advance: on a machine with a CUDA device, install what the checks need
# (keeping the machine's CUDA torch, and its triton where it brings one), run the Triton kernel tests on CUDA and the
# decode benchmark, and write everything under OUT_DIR. Sized to finish in under 8 minutes on one H200.
#
#   benchmarks/gpu_check.sh [OUT_DIR]          # default: $OUT, else out/gpu_check
#   PYTHON=/path/to/python benchmarks/gpu_check.sh
#   PEAK_TBPS=4.8 benchmarks/gpu_check.sh      # override the device's peak bandwidth
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-out/gpu_check}}"
PY="${PYTHON:-python}"
mkdir -p "$OUT_DIR"
unset TRITON_INTERPRET  # compiled kernels: the interpreter is for CPU-only machines
status=0

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || { echo "no CUDA device"; exit 2; }
"$PY" -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$OUT_DIR/device.txt"

# 1. install without replacing the machine's torch (a constraint pins it); CUDA torch wheels pin their own triton,
#    which then stays too (the test extra's triton==3.9.0 would conflict with that pin).
CONS="$OUT_DIR/constraints.txt"
"$PY" -c "import torch; print(f'torch=={torch.__version__}')" > "$CONS"
if "$PY" -c "import triton" 2>/dev/null; then
    "$PY" -c "import triton; print(f'triton=={triton.__version__}')" >> "$CONS"
    timeout 150 "$PY" -m pip install -q -e . "pytest>=9.0" "hypothesis>=6.150" "pytest-timeout>=2.4" -c "$CONS" || status=1
else
    timeout 240 "$PY" -m pip install -q -e '.[test]' -c "$CONS" || status=1
fi
"$PY" -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)" | tee -a "$OUT_DIR/device.txt"

# 2. the kernel tests on CUDA: tests/test_triton_kernels.py runs its tensors on the GPU where CUDA is present
#    (tests/test_cuda.py, the whole library on CUDA against CPU, takes longer: run it separately)
timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py --junitxml "$OUT_DIR/test_triton_kernels.xml" \
    2>&1 | tee "$OUT_DIR/test_triton_kernels.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# 3. the decode benchmark: kernel-level and end to end, JSON in OUT_DIR/gpu_decode.json
timeout 180 "$PY" benchmarks/gpu_decode.py --out "$OUT_DIR" ${PEAK_TBPS:+--peak-tbps "$PEAK_TBPS"} \
    2>&1 | tee "$OUT_DIR/gpu_decode.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "gpu_check: status $status, results in $OUT_DIR"
exit $status
