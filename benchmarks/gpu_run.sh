#!/usr/bin/env bash
# On a lent GPU machine (no network; its own Python with torch and Lightning): the GPU-marked
# tests, the calibration table on CUDA and the one-GPU check, against the working tree.
#   OUT=/some/dir bash benchmarks/gpu_run.sh                     # tests, check, cuda
#   STEPS=tests,check OUT=/some/dir bash benchmarks/gpu_run.sh
# Results in $OUT: machine.txt, tests.txt, gpu_check.txt, calibration_cuda.{md,json} (cuda).
set -u
OUT=${OUT:-/tmp/ipukit-gpu}
STEPS=${STEPS:-tests,check,cuda}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
has() { [[ ",$STEPS," == *",$1,"* ]]; }
{
  date -u; nvidia-smi -L; nproc; lscpu | grep -E "Model name|Thread|Core|Socket|MHz|L3"
  $PY -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))"
} 2>&1 | tee "$OUT/machine.txt"
for step in ${STEPS//,/ }; do
  case $step in
    tests)
      echo "== GPU-marked tests"
      timeout 150 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py 2>&1 \
        | tee "$OUT/tests.txt" | tail -15 ;;
    check)
      echo "== one-GPU check"
      timeout 90 $PY -m benchmarks.gpu_check 2>&1 | tee "$OUT/gpu_check.txt" ;;
    cuda)
      echo "== calibration table on CUDA"
      timeout 300 $PY -m benchmarks.calibration --out "$OUT/cal" 2>&1 \
        | tee "$OUT/calibration.log" | grep -v "^|" | tail -30
      cp "$OUT/cal/calibration.md" "$OUT/calibration_cuda.md" 2>/dev/null
      cp "$OUT/cal/calibration.json" "$OUT/calibration_cuda.json" 2>/dev/null ;;
  esac
done
