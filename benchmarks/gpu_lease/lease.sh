#!/usr/bin/env bash
# One GPU lease's work, on the GPU machine from the repository root, in the background so that the
# parts can be sent while it runs (README.md beside this script has the calls):
#
#   (setsid nohup bash benchmarks/gpu_lease/lease.sh > /tmp/lease.log 2>&1 &)
#
# 1. unpacks .gpu/site.tar.xz; builds the random checkpoints (135M and 7B shapes) from .gpu/smollm2-files
# 2. installs FlashAttention-4 from /tmp/fa4parts once its parts are there (waits FA4_WAIT_S, then goes on
#    without it: its tests skip and say so)
# 3. STEPS (default "suite bench"): the whole `pytest -m gpu` suite, and, once vLLM's parts are in
#    /tmp/parts (waits VLLM_WAIT_S), bench_engine with BENCH_ARGS for PEERS (default ponytail,vllm); also
#    `attn` (bench_attention's decode against FlashAttention-3, ATTN_ARGS) and `e2e` (serve_side_by_side:
#    serve run against vllm serve) and `soak` (benchmarks/soak.py with engine replicas killed under load:
#    two replicas of SOAK_MODEL sharing the card, SOAK_S seconds, one killed every SOAK_KILL_S);
#    SUITE_TESTS narrows the suite. A second run on the same machine skips what the first built.
# Everything it writes goes to /tmp/res (poll.sh tars it into $OUT); /tmp/res/<step>.done marks each step.
set -uo pipefail
RES=/tmp/res; mkdir -p "$RES"; rm -f "$RES"/*.done
# Every device call copies the working tree in again and drops what it does not carry (__pycache__
# included), which can pull modules from under pytest's collection: the steps run from a copy of
# their own, made now. /tmp/pkg links into it.
TREE=/tmp/lease-tree; rm -rf "$TREE" && cp -a "$PWD" "$TREE" && cd "$TREE" || exit 1
STEPS=${STEPS:-"suite bench"}
BENCH_ARGS=${BENCH_ARGS:-"--workload all --rounds 2"}
PEERS=${PEERS:-"ponytail,vllm"}
ATTN_ARGS=${ATTN_ARGS:-"--launch decode_warps=8"}
export PYTHONUNBUFFERED=1
log() { echo "$(date +%T) $*" | tee -a "$RES/steps.log"; }

# Every part named in SHA256SUMS is in $1 and matches its sum; waits up to $2 seconds for that.
parts_ready() {
  local dir=$1 deadline=$(( $(date +%s) + $2 ))
  while [ "$(date +%s)" -lt "$deadline" ]; do
    if [ -f "$dir/SHA256SUMS" ] && (cd "$dir" && grep ' part_' SHA256SUMS | sha256sum -c --quiet - 2>/dev/null); then
      return 0
    fi
    sleep 2
  done
  return 1
}

mkdir -p /tmp/site && tar xJf .gpu/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
# Nothing is pip-installed here: `import ponytail` finds a tree of links laid out as pyproject maps the
# package (ponytail_core/ as ponytail, cuda_kernels/ as ponytail.cuda_kernels).
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -rs "$PWD/ponytail_core" /tmp/pkg/ponytail \
  && ln -s "$PWD/cuda_kernels" /tmp/pkg/ponytail/cuda_kernels && export PYTHONPATH=/tmp/pkg:$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$RES/gpu.txt" 2>&1
git log --oneline -1 > "$RES/tree.txt" 2>/dev/null; git status --short >> "$RES/tree.txt" 2>/dev/null
log "site unpacked; $(head -2 "$RES/gpu.txt" | tail -1)"
# A second lease.sh on the same machine (other STEPS) keeps what the first one built.
# The tests build their own models: only the benchmarks read the random checkpoints.
SOAK_MODEL=${SOAK_MODEL:-/tmp/ponytail-7b-random}
needs_models=0; needs_7b=0
for step in $STEPS; do
  case $step in
    attn|suite) ;;
    e2e) needs_models=1 ;;
    soak) needs_models=1; [ "$SOAK_MODEL" = /tmp/ponytail-7b-random ] && needs_7b=1 ;;
    *) needs_models=1; needs_7b=1 ;;
  esac
done
if [ "$needs_models" = 1 ] && [ ! -f /tmp/ponytail-smollm2-random/config.json ]; then
  python3 benchmarks/random_checkpoint.py build .gpu/smollm2-files /tmp/ponytail-smollm2-random > "$RES/ckpt.log" 2>&1
  log "135M checkpoint built (rc $?)"
fi
if [ "$needs_7b" = 1 ] && [ ! -f /tmp/ponytail-7b-random/config.json ]; then
  python3 benchmarks/random_checkpoint.py build .gpu/smollm2-files /tmp/ponytail-7b-random --shape 7b \
    --device cuda >> "$RES/ckpt.log" 2>&1
  log "7B checkpoint built (rc $?)"
fi

if [ -d /tmp/fa4site/flash_attn ]; then
  export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
elif parts_ready /tmp/fa4parts "${FA4_WAIT_S:-120}"; then
  mkdir -p /tmp/fa4 && cat /tmp/fa4parts/part_* | tar xf - -C /tmp/fa4
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fa4site /tmp/fa4/wheels/*.whl \
    > "$RES/fa4_install.log" 2>&1
  export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
  log "FlashAttention-4: $(python3 -c 'import flash_attn.cute; print("importable")' 2>&1 | tail -1)"
else
  log "FlashAttention-4 parts not there: going on without it"
fi

VP=/tmp/vsite:/tmp/vsite/nvidia_cutlass_dsl/dsl_packages
# vLLM from its parts in /tmp/parts (waits VLLM_WAIT_S for them), once per machine.
install_vllm() {
  [ -f "$RES/vllm.installed" ] && return 0
  if ! parts_ready /tmp/parts "${VLLM_WAIT_S:-300}"; then log "vLLM parts not there"; return 1; fi
  if ! bash /tmp/parts/install.sh /tmp/parts /tmp/vsite > "$RES/vllm_install.log" 2>&1; then
    log "vLLM install failed (vllm_install.log)"; return 1
  fi
  touch "$RES/vllm.installed"; log "vLLM installed"
}

for step in $STEPS; do
  case $step in
    suite)
      # shellcheck disable=SC2086
      python3 -m pytest -q -m gpu ${SUITE_TESTS:-tests/} -p no:cacheprovider -rs > "$RES/suite.log" 2>&1
      # pytest's summary line; a CUDA warning printed at exit may come after it
      log "suite: $(grep -E '[0-9]+ (passed|failed)' "$RES/suite.log" | tail -1)" ;;
    attn)  # the decode kernel's launch variants against SDPA and vLLM's FlashAttention-3, MHA shapes
      fa3=--fa3  # ATTN_FA3=0: our kernel and SDPA only, no vLLM install
      if [ "${ATTN_FA3:-1}" = 0 ]; then fa3=""; elif ! install_vllm; then log "attn skipped"; continue; fi
      # shellcheck disable=SC2086
      (cd benchmarks && PYTHONPATH=$PYTHONPATH:$VP python3 bench_attention.py --decode-only \
        --only "${ATTN_ONLY:-Hkv=32}" $fa3 $ATTN_ARGS --json "$RES/attn.json") > "$RES/attn.log" 2>&1
      log "attn: rc $?" ;;
    bench)  # vLLM is installed only when PEERS names it
      if [[ ",$PEERS," == *",vllm,"* ]] && ! install_vllm; then log "bench skipped"; continue; fi
      # shellcheck disable=SC2086
      python3 benchmarks/bench_engine.py --model /tmp/ponytail-7b-random $BENCH_ARGS --peers "$PEERS" \
        --vllm-python "$(command -v python3)" --vllm-pythonpath "$VP" --vllm-workdir "/tmp/vllm-run-$(date +%s)" \
        --json "$RES/peers.json" > "$RES/bench.log" 2>&1
      log "bench: rc $?" ;;
    e2e)  # serve run deployments/app.yaml against vllm serve, the 135M shape, one server at a time
      if ! install_vllm; then log "e2e skipped"; continue; fi
      python3 benchmarks/serve_side_by_side.py --model /tmp/ponytail-smollm2-random --servers ponytail,vllm \
        --vllm-python "$(command -v python3)" --vllm-pythonpath "$VP" --json "$RES/side.json" > "$RES/side.log" 2>&1
      log "e2e: rc $?" ;;
    soak)  # engine replicas killed under mixed load; served as the soak's requests name the model
      python3 benchmarks/soak.py --start --duration-s "${SOAK_S:-600}" --kill-every-s "${SOAK_KILL_S:-60}" \
        --workers 8 --json "$RES/soak.json" --app-args "{\"model\": \"$SOAK_MODEL\", \"device\": \"cuda\",
        \"served_model_name\": \"SmolLM2-135M-Instruct\", \"num_gpus\": 0.5, \"kv_cache_memory\": \"8GiB\",
        \"max_num_seqs\": 64, \"max_model_len\": 4096, \"min_replicas\": 2, \"max_replicas\": 2}" \
        > "$RES/soak.log" 2>&1
      log "soak: rc $? $(grep -E 'silent truncations|5xx other' "$RES/soak.log" | tr '\n' ' ')" ;;
    *) log "unknown step $step" ;;
  esac
  touch "$RES/$step.done"
done
touch "$RES/all.done"; log "all done"
