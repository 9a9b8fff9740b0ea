#!/usr/bin/env bash
# One draft stage (python -m train.stage), and the decoding measurement (scripts/gpu_decode.py), on a lent GPU
# machine, which has its own PyTorch with CUDA but no network, no project venv, no wheel data and no `gguf`
# package. See scripts/README.md for the exact calls.
#
#   bash scripts/gpu_stage.sh pack              here (CPU): fill .stage/p1 .. .stage/pN (git-ignored) with
#                                               the target GGUF in pieces, the `gguf` wheel and the id data,
#                                               each piece small enough to travel beside the repository
#   bash scripts/gpu_stage.sh receive           there: move the carried .stage/p* into $STAGE (kept while
#                                               the machine stays warm) and list what is there
#   bash scripts/gpu_stage.sh run MINUTES       there: receive, check every piece, install the wheel, put
#                                               the GGUF together, run the stage (resumes if $STAGE/out
#                                               holds an interrupted one), pack the results into $OUT
#   bash scripts/gpu_stage.sh decode [ARGS]     there: receive and check as `run` does (after it, on the same
#                                               warm machine, nothing more need travel), then
#                                               scripts/gpu_decode.py ARGS on the payload's GGUF and prompts
#   bash scripts/gpu_stage.sh unpack DIR OUTDIR here: put the returned pieces together into OUTDIR
#
# Why pieces: a call carries at most 64 MiB with the repository (32 MiB tracked), the GGUF is 94 MiB; and
# a returned file may be at most 16 MiB (the draft alone is 19 MiB), so results come back as a split tar.
set -euo pipefail

STAGE=${STAGE:-/tmp/maverick-stage}
INIT_DRAFT=${INIT_DRAFT:-eagle3/drafts/smollm2-135m-instruct}
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf

tracked_mib() {  # what travels anyway: tracked and untracked-not-ignored files
  git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | awk '{print $1 / 1048576}'
}

pack() {
  local py=${PYTHON:-.venv/bin/python}
  [ -x "$py" ] || py=python3
  rm -rf .stage/p[0-9]* .stage/build
  mkdir -p .stage/build
  local gguf data
  gguf=$("$py" -c 'from maverick.gguf_loader import default_gguf_path; print(default_gguf_path())')
  data=.stage/data.jsonl.xz
  if [ ! -s "$data" ] || [ -n "${ANSWERS:-}" ]; then  # ANSWERS: earlier stages' answers.jsonl.xz, folded in
    local extra=() f
    for f in ${ANSWERS:-}; do extra+=(--answers "$f"); done
    "$py" -m train.stage_data --out "$data" --answered "$INIT_DRAFT/regen_h200.jsonl.xz" --answered-cut-tokens 320 \
      "${extra[@]}"
  fi
  local ver
  ver=$("$py" -c 'import importlib.metadata as m; print(m.version("gguf"))')
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d .stage/build "gguf==$ver"
  # one stream of bytes: wheel + data + GGUF, cut into pieces that fit beside the repository
  cp "$data" .stage/build/data.jsonl.xz
  "$py" scripts/gpu_decode.py --prepare --n 80 --prompts .stage/build/gpu_prompts.json
  cp "$gguf" ".stage/build/$GGUF_NAME"
  (cd .stage/build && sha256sum -- * > SHA256SUMS && tar -cf ../payload.tar -- *)
  local room
  room=$(awk -v t="$(tracked_mib)" 'BEGIN { r = int(64 - t - 2); if (r > 30) r = 30; print r }')
  if [ "$room" -lt 8 ]; then echo "error: the repository alone is $(tracked_mib) MiB; no room to carry pieces" >&2; exit 2; fi
  split -b "${room}M" -d -a 1 .stage/payload.tar .stage/piece.
  local i=1
  for f in .stage/piece.*; do mkdir -p ".stage/p$i"; mv "$f" ".stage/p$i/payload.$(printf %02d $((i - 1)))"; i=$((i + 1)); done
  (cd .stage && sha256sum payload.tar | awk '{print $1}' > expected.sha256 && cp expected.sha256 p$((i - 1))/payload.sha256)
  echo "$((i - 1)) pieces of at most $room MiB (the repository travels with each: $(tracked_mib) MiB):"
  ls -la .stage/p*/
  rm -rf .stage/build .stage/payload.tar
}

receive() {
  mkdir -p "$STAGE/in"
  for d in .stage/p*/; do [ -d "$d" ] && cp -f "$d"* "$STAGE/in/"; done
  ls -la "$STAGE/in"
}

assemble() {  # the received pieces -> $STAGE/payload (checked), the gguf wheel on PYTHONPATH
  receive
  [ -n "${OUT:-}" ] || { echo "error: \$OUT is not set (run this through the device tool)" >&2; exit 2; }
  # assembled once per payload: again when the last piece names another one (a new pack on a warm machine);
  # unpacked beside and renamed into place, so a call killed half-way never leaves a payload that looks whole
  if [ ! -f "$STAGE/payload/payload.sha256" ] || { [ -f "$STAGE/in/payload.sha256" ] &&
       ! cmp -s "$STAGE/in/payload.sha256" "$STAGE/payload/payload.sha256"; }; then
    [ -f "$STAGE/in/payload.sha256" ] || { echo "error: the last piece (payload.sha256) has not arrived; carry it" >&2; exit 2; }
    cat "$STAGE"/in/payload.[0-9][0-9] > "$STAGE/payload.tar"
    if [ "$(sha256sum "$STAGE/payload.tar" | awk '{print $1}')" != "$(cat "$STAGE/in/payload.sha256")" ]; then
      echo "error: pieces missing or damaged (a fresh machine loses the earlier calls' pieces):" >&2
      ls -la "$STAGE/in" >&2
      exit 3
    fi
    rm -rf "$STAGE/payload.new" && mkdir -p "$STAGE/payload.new"
    tar -xf "$STAGE/payload.tar" -C "$STAGE/payload.new"
    (cd "$STAGE/payload.new" && sha256sum -c --quiet SHA256SUMS)
    cp "$STAGE/in/payload.sha256" "$STAGE/payload.new/payload.sha256"
    rm -rf "$STAGE/payload" && mv "$STAGE/payload.new" "$STAGE/payload"
    rm -f "$STAGE/payload.tar"
  fi
  "${DEVICE_PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$STAGE"/payload/gguf-*.whl
  export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
  # the GPU's name goes into the logs, not a file of its own: $OUT returns at most 8 files (run: 3 + 4 pieces)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
}

run() {
  local minutes=${1:?minutes}
  assemble
  if [ "${RUN_TESTS:-1}" = 1 ]; then  # this work's CUDA tests first (at most 100 s; RUN_TESTS=0 skips them)
    timeout --foreground -k 10 100 "${DEVICE_PYTHON:-python3}" -m pytest -q -p no:cacheprovider -m cuda tests/test_fastgen.py \
      tests/test_fastfit.py > "$OUT/cuda_tests.log" 2>&1 || true
    tail -3 "$OUT/cuda_tests.log"
  fi
  # the stage stops itself at its budget; the timeout only guards against a hang, so packing always runs:
  # Ctrl-C first (the stage flushes what it has), a kill 20 s later (a hang in native code ignores Ctrl-C).
  # --foreground keeps both in the call's process group: without it `timeout` makes a group of its own, and a
  # call the device tool stops at its limit (by group) left the stage running, to race the next call's stage.
  # Worst case with the tests: ~5 + 110 + 5.5 * 60 + 90 + 20 + packing ~ 560 s, the README's timeout_s
  local limit=$(awk -v m="$minutes" 'BEGIN { print int(m * 60 + 90) }')
  set +e
  timeout --foreground -k 20 --signal=INT "$limit" "${DEVICE_PYTHON:-python3}" -m train.stage --minutes "$minutes" --init-draft "${INIT:-$INIT_DRAFT}" \
    --out "$STAGE/out" --target "$STAGE/payload/$GGUF_NAME" --data "$STAGE/payload/data.jsonl.xz" \
    ${STAGE_ARGS---max-answers-mib 30 --profile-steps 8} 2>&1 | tee "$OUT/stage.log"
  local rc=${PIPESTATUS[0]}
  set -e
  echo "train.stage exit status $rc" | tee -a "$OUT/stage.log"
  cp -f "$STAGE/out/stage.json" "$OUT/" 2>/dev/null || true
  # results as pieces of at most 15 MiB (a returned file may be 16 MiB), the resumable state left out
  if [ -d "$STAGE/out" ]; then
    tar -C "$STAGE" --exclude=train_state.pt --exclude='*.tmp-*' -cf - out | split -b 15M -d -a 1 - "$OUT/out.tar."
  fi
  ls -la "$OUT"
  return "$rc"
}

decode() {  # there: tokens/s per user (scripts/gpu_decode.py) on the payload's GGUF and prompts
  assemble
  "${DEVICE_PYTHON:-python3}" scripts/gpu_decode.py --gguf "$STAGE/payload/$GGUF_NAME" \
    --prompts "$STAGE/payload/gpu_prompts.json" --out "$OUT" "$@" 2>&1 | tee "$OUT/decode.log"
  return "${PIPESTATUS[0]}"
}

unpack() {
  local from=${1:?directory with out.tar.N} to=${2:?output directory}
  mkdir -p "$to"
  rm -rf "$to/.unpacking" && mkdir "$to/.unpacking"
  # whole or nothing: a missing piece leaves no half-written draft behind
  if ! cat "$from"/out.tar.[0-9] | tar -xf - -C "$to/.unpacking"; then
    rm -rf "$to/.unpacking"
    echo "error: $from: the pieces out.tar.N do not make a whole archive (one missing or cut?)" >&2
    exit 3
  fi
  rm -rf "$to/out" && mv "$to/.unpacking/out" "$to/out" && rmdir "$to/.unpacking"
  echo "unpacked into $to/out"
}

case "${1:-}" in
  pack) pack ;;
  receive) receive ;;
  run) shift; run "$@" ;;
  decode) shift; decode "$@" ;;
  unpack) shift; unpack "$@" ;;
  *) echo "usage: bash scripts/gpu_stage.sh pack | receive | run MINUTES | decode [ARGS] | unpack DIR OUTDIR" >&2; exit 2 ;;
esac
