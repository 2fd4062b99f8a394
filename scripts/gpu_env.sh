# Sourced by scripts/gpu_run.sh and scripts/gpu_headline.sh: what a run on a lent GPU machine (or
# its CPU dry run) sets up before measuring.
#
#   gpu_env NAME   $OUT (default ./gpu_out) with $OUT/log.txt, every later line of output teed into
#                  it; the offline environment; $PY, the Python to run, and DRY (1 or 0):
#                  GPU_RUN_DRY=1: the repo's .venv (or $PYTHON), Triton's interpreter, src/ on the path;
#                  else: python3 with the carried .whl/*.whl installed into /tmp/site, ahead of the
#                  image's packages (the image has no registry), and src/ on the path.
gpu_env() {
    local name=$1
    OUT=${OUT:-$PWD/gpu_out}
    mkdir -p "$OUT"
    : >"$OUT/log.txt"
    exec > >(tee -a "$OUT/log.txt") 2>&1
    export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
    if [[ "${GPU_RUN_DRY:-0}" != 0 ]]; then
        # CPU dry run: no install (the dev venv has the stack), kernels through Triton's interpreter.
        PY=${PYTHON:-$PWD/.venv/bin/python}
        export TRITON_INTERPRET=1 PYTHONPATH=$PWD/src
        DRY=1
        echo "$name: dry run on CPU with $PY"
    else
        PY=python3
        unset TRITON_INTERPRET
        shopt -s nullglob
        local wheels=(.whl/*.whl)
        if ((${#wheels[@]} == 0)); then
            echo "$name: no wheels in .whl/ (run python scripts/prepare_gpu_wheels.py here, carry [\".whl\"])" >&2
            exit 2
        fi
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "${wheels[@]}"
        export PYTHONPATH=/tmp/site:$PWD/src
        DRY=0
    fi
}
