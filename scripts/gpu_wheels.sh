#!/bin/bash
# Download the wheels scripts/gpu_session.sh installs on a GPU machine that cannot reach a
# package index: each package at the version this tree's .venv holds (run `make setup`
# first), for CPython 3.12 on x86-64 Linux. .whl/ gets what the GPU image lacks or holds at
# another version for the models (transformers and what it imports), .whl-serve/ the server's
# (websockets: its realtime and speech sockets, and their clients; aiohttp: the benchmarks'
# timed client) and diffusers' (accelerate, ftfy: Wan's pipelines), .whl-tools/ py-spy
# (gpu_session.sh's SPY=1: where a served process's threads spend their time), .whl-av/ PyAV
# (MP4 video, audio formats but WAV and PCM: 36 MB, over what a call carries beside the
# others: gpu_session.sh's `av` part installs it from a call of its own on the same
# machine). All stay out of git (.git/info/exclude).
set -eu
cd "$(dirname "$0")/.."
MODELS="lark msgspec pyzmq transformers tokenizers huggingface_hub safetensors httpx2 httpcore2
  click hf-xet typing_extensions regex anyio idna truststore h11 kernels tomlkit"
SERVE="diffusers fastapi starlette uvicorn pydantic pydantic_core annotated-types annotated-doc
  typing-inspection python-multipart soundfile cffi pycparser httptools openai jiter
  sniffio opentelemetry-api importlib_metadata zipp websockets accelerate psutil ftfy wcwidth
  prometheus-client uvloop aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache
  yarl"
for dir in .whl .whl-serve .whl-tools .whl-av; do
  grep -qx "/$dir/" .git/info/exclude 2>/dev/null || echo "/$dir/" >> .git/info/exclude
done
pinned() {
  for name in "$@"; do
    echo "$name==$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$name'))")"
  done
}
download() {
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$@"
}
# shellcheck disable=SC2086
download .whl $(pinned $MODELS)
# shellcheck disable=SC2086
download .whl-serve $(pinned $SERVE)
download .whl-tools py-spy==0.4.3
download .whl-av $(pinned av)
du -sh .whl .whl-serve .whl-tools .whl-av
