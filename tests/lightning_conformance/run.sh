#!/usr/bin/env bash
# Lightning's own tests for FSDPStrategy and ModelParallelStrategy, run against Lightning's classes
# or, with only the strategy import changed, against fsdp_cli's. Nothing is fetched and nothing of
# Lightning's is kept: its tests are copied into a scratch folder, rewritten there, run, removed.
#
#   tests/lightning_conformance/run.sh LIGHTNING_CHECKOUT [lightning|ours|fsdp2] [unit|integration|all]
#
# LIGHTNING_CHECKOUT: a checkout of github.com/Lightning-AI/pytorch-lightning at the tag of the
#   installed release (python -c "import lightning; print(lightning.__version__)"), e.g.
#     git clone --depth 1 --branch 2.6.5 https://github.com/Lightning-AI/pytorch-lightning
# lightning: Lightning's classes (the reference count on this machine)
# ours:      FSDPStrategy -> fsdp_cli.strategies.FSDP1Strategy,
#            ModelParallelStrategy -> fsdp_cli.strategies.ModelParallelStrategy
# fsdp2:     ModelParallelStrategy -> fsdp_cli.strategies.FSDP2Strategy (test_fsdp.py is not run)
# unit:        tests_pytorch/strategies/test_fsdp.py, test_model_parallel.py (one pytest process)
# integration: tests_pytorch/strategies/test_model_parallel_integration.py, each test in its own
#              process (Lightning's "standalone" tests: the Trainer starts the other ranks by
#              re-running the command). Without CUDA the device is changed to CPU processes on gloo
#              and the GPU-count requirement dropped; nothing else in the tests changes.
# Environment: CONFORMANCE_LOCK=FILE runs each pytest under `flock FILE` (shared machines);
#              CONFORMANCE_TIMEOUT seconds per pytest process (default 600); KEEP=1 keeps the scratch copy.
set -euo pipefail

src=${1:?usage: run.sh LIGHTNING_CHECKOUT [lightning|ours|fsdp2] [unit|integration|all]}
mode=${2:-ours}
what=${3:-all}
src=$(cd "$src" && pwd)
[[ -f $src/tests/tests_pytorch/strategies/test_fsdp.py ]] || { echo "run.sh: $src is not a Lightning checkout" >&2; exit 2; }
case $mode in lightning|ours|fsdp2) ;; *) echo "run.sh: mode must be lightning, ours or fsdp2" >&2; exit 2 ;; esac
case $what in unit|integration|all) ;; *) echo "run.sh: what must be unit, integration or all" >&2; exit 2 ;; esac

scratch=$(mktemp -d "${TMPDIR:-/tmp}/lightning-conformance.XXXXXX")
[[ ${KEEP:-0} == 1 ]] || trap 'rm -rf "$scratch"' EXIT
cp -r "$src/tests" "$scratch/tests"
cp "$src/pyproject.toml" "$scratch/"   # Lightning's pytest settings (markers, warning filters)
strategies=$scratch/tests/tests_pytorch/strategies

# --- the only change to the tests: which class the name refers to
case $mode in
ours)
  sed -i 's/^from lightning\.pytorch\.strategies import FSDPStrategy$/from fsdp_cli.strategies import FSDP1Strategy as FSDPStrategy/' "$strategies/test_fsdp.py"
  sed -i 's/^from lightning\.pytorch\.strategies import ModelParallelStrategy$/from fsdp_cli.strategies import ModelParallelStrategy/' \
    "$strategies/test_model_parallel.py" "$strategies/test_model_parallel_integration.py" ;;
fsdp2)
  sed -i 's/^from lightning\.pytorch\.strategies import ModelParallelStrategy$/from fsdp_cli.strategies import FSDP2Strategy as ModelParallelStrategy/' \
    "$strategies/test_model_parallel.py" "$strategies/test_model_parallel_integration.py" ;;
esac
if [[ $mode != lightning ]]; then
  grep -q '^from fsdp_cli' "$strategies/test_model_parallel.py" || { echo "run.sh: import rewrite did not apply" >&2; exit 1; }
fi

# --- the integration tests ask for CUDA GPUs: on a machine without them, CPU processes on gloo
if ! python -c 'import sys, torch; sys.exit(0 if torch.cuda.device_count() >= 4 else 1)'; then
  sed -i -E \
    -e 's/, *min_cuda_gpus=[0-9]+//; s/min_cuda_gpus=[0-9]+, *//' \
    -e 's/marks=RunIf\(bf16_cuda=True\)/marks=()/' \
    -e 's/accelerator="(cuda|gpu)"/accelerator="cpu"/; s/"accelerator": "(cuda|gpu)"/"accelerator": "cpu"/' \
    -e 's/torch\.device\("cuda", self\.local_rank\)/torch.device("cpu")/' \
    -e 's/device\.type == "cuda"/device.type == "cpu"/g' \
    "$strategies/test_model_parallel_integration.py"
fi

run_pytest() {  # run_pytest LOG ARGS... ; prints nothing, returns pytest's status
  local log=$1; shift
  # Lightning's settings make every FutureWarning an error; torch 2.13 (newer than Lightning 2.6's
  # CI) deprecates the all_gather that LightningModule.all_gather uses: that one warning is ignored.
  local cmd=(timeout "${CONFORMANCE_TIMEOUT:-600}" python -m pytest -p no:cacheprovider -v -rfE --no-header --color=no
    -W "ignore:torch.distributed.nn.functional.all_gather is deprecated:FutureWarning" "$@")
  [[ -n ${CONFORMANCE_LOCK:-} ]] && cmd=(flock "$CONFORMANCE_LOCK" "${cmd[@]}")
  (cd "$scratch/tests" && "${cmd[@]}") >"$log" 2>&1
}

results=$scratch/results.txt
: >"$results"
tally() {  # one line per test from pytest -v ("ID PASSED [ 5%]"); a test fails if it failed on any rank
  grep -oE '^[^ ]+::[^ ]+ (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)' "$1" \
    | awk '{ if (!($1 in s) || $2 ~ /FAILED|ERROR/) s[$1] = $2 } END { for (t in s) print s[t], t }' >>"$results" || true
}

if [[ $what != integration ]]; then
  files=(tests_pytorch/strategies/test_model_parallel.py)
  [[ $mode != fsdp2 ]] && files=(tests_pytorch/strategies/test_fsdp.py "${files[@]}")
  run_pytest "$scratch/unit.log" "${files[@]}" || true
  tally "$scratch/unit.log"
fi

if [[ $what != unit ]]; then
  file=tests_pytorch/strategies/test_model_parallel_integration.py
  mapfile -t ids < <(cd "$scratch/tests" && PL_RUN_STANDALONE_TESTS=1 python -m pytest -p no:cacheprovider -q --collect-only "$file" 2>/dev/null | grep '::' | sed 's%^tests/%%')
  for id in "${ids[@]}"; do
    log=$scratch/integration.$(echo "$id" | tr -c 'A-Za-z0-9_\n' _).log
    status=0
    PL_RUN_STANDALONE_TESTS=1 run_pytest "$log" "$id" || status=$?
    before=$(wc -l <"$results")
    tally "$log"
    if [[ $(wc -l <"$results") == "$before" ]]; then  # killed or timed out before pytest's summary
      echo "FAILED $id - exit status $status, no pytest summary (see log)" >>"$results"
    fi
  done
fi

echo "== Lightning $(python -c 'import lightning; print(lightning.__version__)') tests from $src, classes: $mode"
sort -k2 "$results"
for s in PASSED FAILED ERROR SKIPPED; do printf '%s %s  ' "$(grep -c "^$s " "$results" || true)" "${s,,}"; done
echo
[[ ${KEEP:-0} == 1 ]] && echo "scratch copy and logs: $scratch"
! grep -qE '^(FAILED|ERROR) ' "$results"
