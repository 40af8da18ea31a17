#!/usr/bin/env bash
# On a lent GPU machine (no network; its own Python with torch and Lightning): the GPU-marked
# tests, the calibration table on CUDA, the one-GPU check, and the CPU calibration table on
# 2-core sets of its host's idle cores, against the working tree.
#   OUT=/some/dir bash benchmarks/gpu_run.sh                     # tests, check, cuda
#   STEPS=cpu,tests,check OUT=/some/dir bash benchmarks/gpu_run.sh
# Results in $OUT: machine.txt, tests.txt, gpu_check.txt, calibration_cuda.{md,json} (cuda),
# cpu_pairs.log and cpu_pairs_N.{md,json} (cpu: benchmarks/cpu_pairs.py).
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
    cpu)
      echo "== CPU calibration table on 2-core sets"
      timeout ${CPU_TIMEOUT:-330} $PY -m benchmarks.cpu_pairs --out /tmp/cpu_pairs \
        > "$OUT/cpu_pairs.log" 2>&1
      echo "exit $?"; grep -E "^\[|sets of|within ±15" "$OUT/cpu_pairs.log"
      cat /tmp/cpu_pairs/r*.log >> "$OUT/cpu_pairs.log" 2>/dev/null
      cp /tmp/cpu_pairs/cpu_pairs_*.md /tmp/cpu_pairs/cpu_pairs_*.json "$OUT"/ 2>/dev/null ;;
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
