#!/bin/bash
# Run on a lent GPU machine from a copy of this tree (see docs/testing.md): installs the
# carried wheels into /tmp/site, links dsl/ and kernels/ into omniflow/ (as pyproject's
# package-dir maps them) and omniflow/ into /tmp/site (so this tree's root, whose kernels/
# would shadow PyPI's `kernels`, never goes on sys.path: Python runs with -P from here), then
# runs the parts named as arguments: setup av tests edges steps skinny moe kernels frames
# code2wav tts windows build streaming long load omni-input diffusion attention wan-build
# wan-a14b wan-ti2v wan-serve cold cold-load cold-fresh tts-cold
# ab (AB_PARTS run on the tree, then with another revision's files: scripts/ab_files.sh)
# omni-build omni-steps omni-load omni-cold (Qwen3-Omni at full depth, built into memory: their
# OMNIFLOW_CACHE is /dev/shm/omniflow-cache, or where /dev/shm cannot hold the whole build
# the disk's cache with the shards that do not fit there spilling into /dev/shm; omni-load:
# OMNI_PRESETS, default "b a", and OMNI_ARGS added to load.py's flags)
# (streaming and long: DEVICES, default 1xH200, and ALSO_DEVICES beside it, e.g. DEVICES=2xH200
# ALSO_DEVICES=1xH200, and STREAMING_ARGS added to the benchmark's, e.g. "--breakdown
# --lookahead 24 12"; windows: WINDOW_KERNELS=N adds each replay's N costliest kernels;
# load: LOAD_ARGS, e.g. "--graph graphs/qwen3_omni.omni --scaled 0.5"; diffusion:
# DIFFUSION_ARGS; SPY=1 runs load and tts under py-spy, every process of the run sampled
# SPY_RATE times a second, default 40, into $OUT/<part>.spy.gz: `python
# scripts/spy_summary.py FILE` reads it). Logs go to $OUT (or /tmp/out). Wheels: scripts/gpu_wheels.sh downloads them here, .whl/ (what the GPU image
# lacks, and the transformers this tree is tested with), .whl-serve/ (the server's and
# diffusers') and .whl-tools/ (py-spy): carry all three; .whl-av/ (PyAV) goes in a call of
# its own, `av`, before the parts that need it (wan-serve).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export OMNIFLOW_CACHE=${OMNIFLOW_CACHE:-/tmp/omniflow-cache}
export PYTHONPATH=/tmp/site
# Wan2.2-A14B at full depth is 69 GB, more than the 64 GiB disk: its build lives on /dev/shm.
wan_cache() {  # MODEL DEPTH
  case "$1 $2" in
    *A14B*" 1"|*A14B*" 1.0"|"t2v 1"|"t2v 1.0")
      export OMNIFLOW_CACHE=/dev/shm/omniflow-cache
      echo "OMNIFLOW_CACHE=$OMNIFLOW_CACHE: $(df -h /dev/shm | tail -1)" ;;
  esac
}
OMNI_MODEL=Qwen/Qwen3-Omni-30B-A3B-Instruct
OMNI_BUILD=Qwen--Qwen3-Omni-30B-A3B-Instruct-1  # scaled_checkpoint's folder for depth 1
omni_built() { [ -e "$1/scaled/$OMNI_BUILD/omniflow_scaled.json" ]; }  # its finished marker
OMNI_GIB=70  # the build's ~66 GiB and some room
free_gib() { mkdir -p "$1" && df -B1G --output=avail "$1" | tail -1 | tr -d ' '; }
omni_cache() {
  # The cache the full-depth build is in, else the one it goes into: /dev/shm where it
  # holds the whole build, else the disk's (the builder spills what does not fit there
  # into /dev/shm: scaled.build_scaled).
  for dir in /dev/shm/omniflow-cache "$OMNIFLOW_CACHE"; do
    omni_built "$dir" && { echo "$dir"; return; }
  done
  if [ "$(free_gib /dev/shm)" -ge $OMNI_GIB ]; then echo /dev/shm/omniflow-cache; else echo "$OMNIFLOW_CACHE"; fi
}
OMNI_CACHE=$(omni_cache)
spied() {  # PART: with SPY set, the command after it runs under py-spy into $OUT/PART.spy
  [ -n "${SPY:-}" ] && echo /tmp/tools/bin/py-spy record --subprocesses --idle --rate ${SPY_RATE:-40} \
    --format raw -o "$OUT/$1.spy" --
}
set_up() {
  # Compiled to bytecode as a user's install is: the GPU image ships torch's packages without
  # it (and sets PYTHONDONTWRITEBYTECODE), so every process compiled each module it imported
  # from source (Qwen3-TTS ready in 38.1 s without, 27.9 s with, on an H100).
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl .whl-serve/*.whl > "$OUT/setup.log" 2>&1 \
    || { cat "$OUT/setup.log"; exit 1; }
  ln -sfn ../dsl omniflow/dsl && ln -sfn ../kernels omniflow/kernels
  python3 -m compileall -q -j 0 omniflow "$(python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
    >> "$OUT/setup.log" 2>&1
  ln -sfn "$here/omniflow" /tmp/site/omniflow
  if compgen -G ".whl-tools/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/tools .whl-tools/*.whl >> "$OUT/setup.log" 2>&1
  fi
  python3 -P -c "import torch, transformers, triton, omniflow.kernels.sampling, omniflow.dsl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$OUT/setup.log"
}
# Each call brings a fresh copy of the tree, without setup's links: a call that does not
# start with `setup` sets up first where they are missing.
# (`av` carries only its own wheel: it needs no setup.)
case "${1:-}" in
  setup|av) ;;
  *) [ -e omniflow/dsl -a -e /tmp/site/omniflow/dsl ] || set_up > /dev/null ;;
esac
for part in "$@"; do
  start=$(date +%s)
  case $part in
    setup)
      set_up
      ;;
    av)
      # PyAV into /tmp/site, from a call that carries .whl-av alone (its 36 MB and the other
      # wheels are more than one call carries): /tmp stays while the machine is held, so the
      # next call's setup finds it (wan-serve's MP4s, speech in formats but WAV and PCM).
      python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site \
        .whl-av/*.whl 2>&1 | tail -2
      python3 -c "import sys; sys.path.insert(0, '/tmp/site'); import av; print('av', av.__version__)"
      ;;
    tests)
      # GPU_TESTS: the test files to run (default: every file with tests marked gpu);
      # TESTS_SHARD=i/n: only every n-th of them from the i-th (1-based), so that a suite
      # longer than one call's limit runs in n calls.
      files=$(echo ${GPU_TESTS:-$(grep -rl "mark.gpu" tests | sort)} | tr ' ' '\n' \
        | awk -v shard="${TESTS_SHARD:-1/1}" 'BEGIN { split(shard, s, "/") } (NR - s[1]) % s[2] == 0')
      timeout ${TESTS_S:-450} python3 -P -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
        --durations=15 $files 2>&1 | tee "$OUT/gpu_tests${TESTS_SHARD:+-${TESTS_SHARD%/*}}.log" | tail -40
      ;;
    edges)
      timeout ${EDGES_S:-200} python3 benchmarks/device_edges.py 2>&1 | tee "$OUT/device_edges.log"
      ;;
    steps)
      timeout ${STEPS_S:-150} python3 benchmarks/stage_steps.py --batches 1 10 --steps 24 2>&1 | tee "$OUT/stage_steps.log"
      ;;
    skinny)
      # A decode step's projections, skinny kernel against cuBLAS (SKINNY_ARGS: e.g. --sweep).
      timeout ${SKINNY_S:-300} python3 benchmarks/skinny_matmul.py ${SKINNY_ARGS:-} 2>&1 | tee "$OUT/skinny.log"
      ;;
    moe)
      # One Qwen3-Omni MoE layer, fused kernels against transformers' block (MOE_ARGS: e.g.
      # "--stage talker", "--sweep --tokens 1 32").
      timeout ${MOE_S:-300} python3 benchmarks/fused_moe.py ${MOE_ARGS:-} 2>&1 | tee "$OUT/fused_moe.log"
      ;;
    frames)
      # Qwen3-TTS's frame step at real size, eager and graphs, batches 1, 16, 64 (FRAMES_ARGS
      # added to benchmarks/tts_frames.py's flags).
      timeout ${FRAMES_S:-300} python3 benchmarks/tts_frames.py ${FRAMES_ARGS:-} 2>&1 \
        | grep -v -i "warn" | tee "$OUT/tts_frames.log"
      ;;
    code2wav)
      # code2wav's step per (batch, window) at real size, eager and replayed from its graphs
      # (CODE2WAV_ARGS added to benchmarks/code2wav_step.py's flags: Qwen3-TTS's by default,
      # "--family qwen3-omni --precision bfloat16" for Qwen3-Omni's as served).
      timeout ${CODE2WAV_S:-240} python3 benchmarks/code2wav_step.py ${CODE2WAV_ARGS:-} 2>&1 \
        | grep -v -i "warn" | tee "$OUT/code2wav_step.log"
      ;;
    tts)
      # Qwen3-TTS served over HTTP at c = 1, 16, 64 (TTS_ARGS added to tts_serve.py's flags;
      # TTS_CLONE=1 adds the voice clone rows, on the Base checkpoint's build too).
      (cd /tmp && timeout ${TTS_S:-400} $(spied tts) python3 "$here/benchmarks/tts_serve.py" --devices 1xH200 \
        $([ -n "${TTS_CLONE:-}" ] || echo --no-clone) --frames 64 ${TTS_ARGS:-}) 2>&1 | grep -v -i "warn\|model config" \
        | tee "$OUT/tts_serve.log"
      # Traces (TTS_ARGS="--trace $OUT/tts.trace ...") come back only under 16 MiB a file.
      for trace in "$OUT"/*.trace "$OUT"/*.spy; do [ -e "$trace" ] && gzip -f "$trace"; done
      ;;
    kernels)
      timeout ${KERNELS_S:-150} python3 benchmarks/stage_steps.py --modes graphs --batches 1 10 \
        --steps 24 --kernels 15 2>&1 | tee "$OUT/stage_kernels.log"
      ;;
    windows)
      # token2wav's window decode: a stream's first window and the widest, 1 and 10 requests.
      timeout ${WINDOWS_S:-200} python3 benchmarks/token2wav_window.py --device cuda --scaled 1 \
        --frames 36 240 --rows 1 10 --repeats 2 --precisions bfloat16 \
        ${WINDOW_KERNELS:+--kernels $WINDOW_KERNELS} 2>&1 | grep -v -i warn | tee "$OUT/windows.log"
      ;;
    build)
      # BUILD_MODEL: the real model whose random-weight build to make (default Qwen2.5-Omni-7B).
      timeout ${BUILD_S:-200} python3 -P -c "from omniflow.checkpoints.scaled import scaled_checkpoint; print(scaled_checkpoint('${BUILD_MODEL:-Qwen/Qwen2.5-Omni-7B}', 1.0, 'cuda'))" 2>&1 | tail -3 | tee "$OUT/build.log"
      ;;
    streaming)
      (cd /tmp && timeout ${STREAMING_S:-330} python3 "$here/benchmarks/streaming.py" \
        --devices ${DEVICES:-1xH200} ${ALSO_DEVICES:+--also-devices $ALSO_DEVICES} --scaled 1 \
        --concurrency 1 10 --baseline-requests 1 --max-tokens 32 --audio-tokens 160 \
        --decode ${STREAMING_DECODE:-graphs} --variants streaming ${STREAMING_ARGS:-}) 2>&1 | grep -v -i "warn\|model config" \
        | tee "$OUT/streaming.log"
      ;;
    long)
      # The peer's workload: 100 text tokens in, 100 out, ~25 s of audio; no HF baseline.
      (cd /tmp && timeout ${LONG_S:-330} python3 "$here/benchmarks/streaming.py" \
        --devices ${DEVICES:-1xH200} ${ALSO_DEVICES:+--also-devices $ALSO_DEVICES} --scaled 1 \
        --concurrency 1 10 --baseline-requests 0 --prompt-tokens 100 --max-tokens 100 \
        --audio-tokens 1250 --variants streaming ${STREAMING_ARGS:-}) 2>&1 | grep -v -i "warn\|model config" \
        | tee "$OUT/long.log"
      ;;
    load)
      # The peer's workload through HTTP at rising concurrency (benchmarks/load.py; LOAD_ARGS
      # e.g. "--trace $OUT/load.trace --trace-gpu --trace-concurrency 10 32": the trace comes
      # back gzipped).
      (cd /tmp && timeout ${LOAD_S:-500} $(spied load) python3 "$here/benchmarks/load.py" --devices ${DEVICES:-1xH200} \
        --scaled 1 --concurrency 1 10 32 64 ${LOAD_ARGS:-}) 2>&1 | grep -v -i "warn\|model config" \
        | tee "$OUT/load.log"
      for trace in "$OUT"/*.trace "$OUT"/*.spy; do [ -e "$trace" ] && gzip -f "$trace"; done
      ;;
    diffusion)
      # Text-to-image at real width, 15 of the DiT's 60 layers (DIFFUSION_ARGS: e.g. --kernels 12).
      (cd /tmp && timeout ${DIFFUSION_S:-300} python3 "$here/benchmarks/diffusion.py" --device cuda \
        --scaled 0.25 ${DIFFUSION_ARGS:-}) 2>&1 | grep -v -i "warn" | tee "$OUT/diffusion.log"
      ;;
    attention)
      # Which attention kernel is fastest at the DiT shapes (ATTENTION_ARGS: e.g. --tiny on a CPU).
      (cd /tmp && timeout ${ATTENTION_S:-300} python3 "$here/benchmarks/attention.py" \
        ${ATTENTION_ARGS:-}) 2>&1 | grep -v -i "warn" | tee "$OUT/attention.log"
      ;;
    wan-build)
      # The random-weight Wan2.2 builds the wan-* parts load (else each builds its own on first
      # use): T2V-A14B at WAN_DEPTH (default 0.5, 35 GB; 1 is 69 GB, on /dev/shm), TI2V-5B at
      # TI2V_DEPTH (default 1, 23 GB).
      for build in "Wan-AI/Wan2.2-T2V-A14B-Diffusers ${WAN_DEPTH-0.5}" \
                   "Wan-AI/Wan2.2-TI2V-5B-Diffusers ${TI2V_DEPTH-1}"; do
        read -r model depth <<< "$build"
        [ -n "${depth:-}" ] || continue
        (wan_cache "$model" "$depth"; timeout ${WAN_BUILD_S:-580} python3 -P -c "from omniflow.checkpoints.scaled import scaled_checkpoint; print(scaled_checkpoint('$model', $depth, 'cuda'))") 2>&1 \
          | grep -v -i "warn" | tee -a "$OUT/wan_build.log"
      done
      ;;
    wan-a14b|wan-ti2v|wan-serve)
      # Wan2.2 on benchmarks/video.py, 4 steps, on CUDA (WAN_DEVICE; wan-serve's MP4 needs
      # the `av` part first). wan-a14b: T2V-A14B
      # 832x480x81 at WAN_DEPTH (default 0.5; 1 loads from /dev/shm): both experts across
      # boundary_ratio 0.875, a guided step of each against its roofline and beside diffusers'
      # blocks, one video end to end with the GPU's peak memory. wan-ti2v: TI2V-5B at
      # TI2V_DEPTH (default 1) and TI2V_SIZE (default 1280x704x121), the same. wan-serve: one
      # video through omniflow run's /v1/videos (job, progress, MP4, peak memory) of
      # WAN_SERVE_MODEL (t2v, default, at WAN_DEPTH; or ti2v). WAN_ARGS added to video.py's
      # flags, e.g. "--parts a b c --cache 0.1 0.5" (step caching) or "--kernels 12"; at
      # WAN_DEPTH=1 run "--parts a" and "--parts b" as two calls (each loads 57 GB of experts).
      # Tiny on a CPU (the dry check): WAN_DEVICE=cpu WAN_DEPTH= TI2V_DEPTH= TI2V_SIZE="--width 64"
      case $part in
        wan-a14b) model=Wan-AI/Wan2.2-T2V-A14B-Diffusers depth=${WAN_DEPTH-0.5}
                  video="--model t2v --parts a b" ;;
        wan-ti2v) model=Wan-AI/Wan2.2-TI2V-5B-Diffusers depth=${TI2V_DEPTH-1}
                  video="--model ti2v ${TI2V_SIZE---width 1280 --height 704 --frames 121} --parts a b" ;;
        wan-serve) model=${WAN_SERVE_MODEL:-t2v} depth=${WAN_DEPTH-0.5}
                   [ "$model" = ti2v ] && depth=${TI2V_DEPTH-1}
                   video="--model $model --parts e"
                   [ "$model" = ti2v ] && video="$video ${TI2V_SIZE---width 1280 --height 704 --frames 121}"
                   [ "$model" = ti2v ] && model=Wan-AI/Wan2.2-TI2V-5B-Diffusers ;;
      esac
      (wan_cache "$model" "$depth"; cd /tmp && timeout ${WAN_S:-580} python3 "$here/benchmarks/video.py" \
        --device ${WAN_DEVICE:-cuda} --steps 4 --repeats 3 ${depth:+--scaled $depth} $video \
        ${WAN_ARGS:-}) 2>&1 | grep -v -i "warn" | tee "$OUT/$part.log"
      ;;
    omni-input)
      # A 5 s spoken turn against the same turn typed, over HTTP at c = 1 and 10 and in a
      # realtime session (benchmarks/omni_input.py; OMNI_INPUT_ARGS added to its flags).
      (cd /tmp && timeout ${OMNI_INPUT_S:-400} python3 "$here/benchmarks/omni_input.py" \
        --devices ${DEVICES:-1xH200} --scaled 1 ${OMNI_INPUT_ARGS:-}) 2>&1 \
        | grep -v -i "warn\|model config" | tee "$OUT/omni_input.log"
      ;;
    omni-build)
      # The full-depth random-weight Qwen3-Omni (~66 GB, bf16) built on the GPU and written
      # shard by shard under /dev/shm (memory: the 64 GiB disk cannot hold it), once; the
      # other omni-* parts read it there. Refused up front where /dev/shm has no room.
      shm=$(free_gib /dev/shm); disk=0
      [ "$OMNI_CACHE" = /dev/shm/omniflow-cache ] || disk=$(free_gib "$OMNI_CACHE")
      if ! omni_built "$OMNI_CACHE" && [ $((shm + disk)) -lt $OMNI_GIB ]; then
        echo "omni-build: /dev/shm has $shm GiB free and $OMNI_CACHE's disk $disk; the build needs ~66 GiB" \
          | tee "$OUT/omni_build.log"
      else
        echo "omni-build into $OMNI_CACHE (/dev/shm: $shm GiB free)" | tee "$OUT/omni_build.log"
        OMNIFLOW_CACHE=$OMNI_CACHE timeout ${OMNI_BUILD_S:-580} python3 -P -c "from omniflow.checkpoints.scaled import scaled_checkpoint; print(scaled_checkpoint('$OMNI_MODEL', 1.0, 'cuda'))" 2>&1 \
          | grep -v -i "warn" | tail -3 | tee -a "$OUT/omni_build.log"
        du -shL "$OMNI_CACHE/scaled/$OMNI_BUILD" 2>&1 | tee -a "$OUT/omni_build.log"
      fi
      ;;
    omni-steps)
      # The thinker's decode step (fused MoE kernels, captured) at batch 1 and 32 against
      # its weight-read bound: the attention, router and norms, and the experts its rows
      # pick (benchmarks/stage_steps.py --checkpoint; the issue's goal: within 1.5x).
      OMNIFLOW_CACHE=$OMNI_CACHE timeout ${OMNI_STEPS_S:-580} python3 benchmarks/stage_steps.py \
        --checkpoint "$OMNI_CACHE/scaled/$OMNI_BUILD" --modes graphs graphs-unfused \
        --batches 1 32 --slots 32 --steps 24 ${OMNI_STEPS_ARGS:-} 2>&1 | grep -v -i "warn" \
        | tee "$OUT/omni_steps.log"
      ;;
    omni-load)
      # The peer's two workloads (benchmarks/load.py --preset a: 2,500 prompt tokens, 900
      # out with audio, c = 1, 8, 16, 32; b: 100 in, 100 out, c = 1, 10) through HTTP on
      # the full-depth build, one H200 (a preset a run may need its levels split over calls:
      # OMNI_ARGS="--concurrency 1 8", then "--concurrency 16 32").
      for preset in ${OMNI_PRESETS:-b a}; do
        (cd /tmp && OMNIFLOW_CACHE=$OMNI_CACHE timeout ${OMNI_LOAD_S:-580} python3 \
          "$here/benchmarks/load.py" --preset "$preset" --devices 1xH200 --scaled 1 \
          ${OMNI_ARGS:-}) 2>&1 | grep -v -i "warn\|model config" | tee "$OUT/omni_load_$preset.log"
      done
      ;;
    omni-cold)
      # Issue 39's cold start: process start -> ready with the full-depth build cached, and a
      # first spoken answer (a short one: random weights do not end their speech).
      (cd /tmp && OMNIFLOW_CACHE=$OMNI_CACHE timeout ${COLD_S:-400} python3 \
        "$here/benchmarks/cold_start.py" --graph "$here/graphs/qwen3_omni.omni" --devices 1xH200 \
        --scaled 1 --inputs '{"prompt": "Say hello."}' \
        --params '{"max_tokens": 8, "max_audio_tokens": 16}') 2>&1 | grep -v -i "warn\|model config" \
        | tee "$OUT/omni_cold.log"
      ;;
    cold)
      (cd /tmp && timeout ${COLD_S:-200} python3 "$here/benchmarks/cold_start.py" --devices 1xH200 \
        --scaled 1) 2>&1 | grep -v -i "warn\|model config" | tee "$OUT/cold_start.log"
      ;;
    ab)
      # The parts named in AB_PARTS twice on this machine, side by side: on the tree, then with
      # the files scripts/ab_files.sh put under .ab/ (another revision's, carried) in place of
      # the tree's, which are put back after; both rounds' output in $OUT/ab.log.
      [ -e .ab/REV ] || { echo "ab: no .ab/: scripts/ab_files.sh REV PATH..., and carry .ab"; exit 1; }
      swapped=$(cd .ab && find . -type f ! -name REV | sed 's|^\./||')
      for side in tree "$(cat .ab/REV)"; do
        if [ "$side" != tree ]; then
          for f in $swapped; do
            mkdir -p "/tmp/ab-tree/$(dirname "$f")" && cp "$f" "/tmp/ab-tree/$f" && cp ".ab/$f" "$f"
          done
        fi
        echo "== ab: $side" | tee -a "$OUT/ab.log"
        bash "$here/scripts/gpu_session.sh" ${AB_PARTS:?AB_PARTS: the parts to run each way} 2>&1 \
          | tee -a "$OUT/ab.log"
      done
      for f in $swapped; do cp "/tmp/ab-tree/$f" "$f"; done
      ;;
    tts-cold)
      # Qwen3-TTS's cold start at real size (issue 37: process start -> ready <= 20 s, the
      # build cached), each stage's load and capture and what the capture ran: twice, the
      # first run building the checkpoint and compiling the kernels if they are not cached
      # yet, the second the figure (TTS_COLD_ARGS added to cold_start.py's flags; TTS_BATCH=N
      # the graph with its talker's and code2wav's max_batch at N: what serving c=64 as
      # shipped would cost the start, in captures).
      graph="$here/graphs/qwen3_tts.omni"
      if [ -n "${TTS_BATCH:-}" ]; then
        sed -E "/stage (talker|code2wav) /s/max_batch=[0-9]+/max_batch=$TTS_BATCH/" "$graph" \
          > /tmp/qwen3_tts.omni && graph=/tmp/qwen3_tts.omni
      fi
      for run in 1 2; do
        (cd /tmp && timeout ${TTS_COLD_S:-300} python3 "$here/benchmarks/cold_start.py" \
          --graph "$graph" --devices 1xH200 --scaled 1 \
          --inputs '{"text": "Good morning, and welcome to the show.", "voice": "Vivian"}' \
          --params '{"max_tokens": 16}' ${TTS_COLD_ARGS:-}) 2>&1 \
          | grep -v -i "warn\|model config" | tee "$OUT/tts_cold_$run.log"
      done
      ;;
    cold-load)
      # An executor's stages loaded one after another, then at once (issue 38), in one run;
      # then at once first, as the page cache favours whichever order runs second. (Loads
      # at once aborted the process on the H200 on 2026-12-05: run this once that is
      # understood, docs/testing.md "Last GPU run".)
      (cd /tmp && timeout ${COLD_S:-400} python3 "$here/benchmarks/cold_start.py" --devices 1xH200 \
        --scaled 1 --load sequential parallel parallel sequential) 2>&1 \
        | grep -v -i "warn\|model config" | tee "$OUT/cold_start_load.log"
      ;;
    cold-fresh)
      # As on a machine that has never compiled the fused kernels: an empty Triton cache.
      (cd /tmp && TRITON_CACHE_DIR=$(mktemp -d) timeout ${COLD_S:-200} python3 \
        "$here/benchmarks/cold_start.py" --devices 1xH200 --scaled 1) 2>&1 \
        | grep -v -i "warn\|model config" | tee "$OUT/cold_start_fresh.log"
      ;;
  esac
  echo "== $part: $(( $(date +%s) - start )) s" | tee -a "$OUT/times.log"
done
