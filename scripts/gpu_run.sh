#!/usr/bin/env bash
# One call on a lent GPU machine (docs/kernels.md, "Running on a lent GPU"), from the repo root:
#   bash scripts/gpu_run.sh                 # on the machine, with .whl/ carried (scripts/prepare_gpu_wheels.py)
#   GPU_RUN_DRY=1 bash scripts/gpu_run.sh   # here, on CPU: the same steps in --smoke mode, the repo's .venv
# Extra arguments go to scripts/gpu_check.py after the script's own (so they win).
#
# The image has torch 2.11 (CUDA 13), Triton 3.6 and transformers 5.17, and no registry: the carried
# wheels (transformers 5.23) go into /tmp/site, ahead of the image's packages, and hf_magicdec is
# imported from src/. The whole script ends within GPU_RUN_BUDGET_S seconds (default 480): the
# install, the version report, scripts/gpu_check.py under `timeout` (its JSON is rewritten after
# every measurement, so a timeout still returns what was measured) and the markdown table.
# It writes $OUT/gpu_check.json, $OUT/gpu_check.md and $OUT/log.txt ($OUT defaults to ./gpu_out).
#
# The kernel tests (tests/kernels) are not run here: they are written for Triton's CPU interpreter
# (CPU tensors; the module asserts TRITON_INTERPRET=1). gpu_check.py's first stage checks the same
# kernels on the GPU in bf16 and fp16 against the fp32 twin.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
BUDGET=${GPU_RUN_BUDGET_S:-480}
source scripts/gpu_env.sh
gpu_env gpu_run
if ((DRY)); then
    MODE=(--smoke --models llama-3.1-8b)
else
    # One lent call: the headline shape (Llama-3.1-8B, batch 32 x 32K, 8 layers, eager and
    # captured) with the targets' gamma 4 and budget 512 captured (each captured size is a
    # compilation), HF's stock decode step, then the end-to-end comparison at the same shape.
    MODE=(--models llama-3.1-8b --batches 32 --contexts 32768 --graph-gammas 4 --graph-budgets 512
          --e2e 32 32768 128)
fi

echo "gpu_run: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), budget ${BUDGET} s, output in $OUT"
"$PY" - <<'EOF'
import platform, sys
import torch, triton, transformers
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "| triton", triton.__version__,
      "| transformers", transformers.__version__, "from", transformers.__file__)
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)")
EOF
"$PY" scripts/prepare_gpu_wheels.py --verify-env || echo "gpu_run: WARNING: an installed version does not satisfy transformers"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv || true

# What is left of the budget: gpu_check gets all but 30 s (the table and the log), and stops
# starting measurements 60 s before its own `timeout` (the measurement under way finishes or
# is cut off by the timeout; the JSON already holds everything before it).
left=$((BUDGET - (SECONDS - START) - 30))
if ((left < 60)); then
    echo "gpu_run: only ${left} s left for gpu_check; raise GPU_RUN_BUDGET_S" >&2
    exit 3
fi
rc=0
timeout -k 10 "$((left - 10))" "$PY" scripts/gpu_check.py --out "$OUT/gpu_check.json" \
    --budget-s "$((left - 70 > 0 ? left - 70 : 1))" "${MODE[@]}" "$@" || rc=$?
((rc == 124 || rc == 137)) && echo "gpu_run: gpu_check stopped at its ${left} s limit; the JSON holds what it measured"
if [[ -s "$OUT/gpu_check.json" ]]; then
    "$PY" scripts/gpu_report.py "$OUT/gpu_check.json" --out "$OUT/gpu_check.md" && cat "$OUT/gpu_check.md"
else
    echo "gpu_run: gpu_check wrote no JSON" >&2
fi
echo "gpu_run: done in $((SECONDS - START)) s, gpu_check exit status $rc"
exit "$rc"
