#!/usr/bin/env bash
# gpu_check.py on a CUDA 13 machine without network (the lent H200), from the repo root:
#   STAGE=dir holding: faiss_gpu-1.15.1-*.whl, nvidia_cuda_runtime_cu12-*.whl, libcublas.so.12 and
#   libcublasLt.so.12 from cublas12_shim.py, model/ (the MiniLM folder).
# Carried in pieces under the 64 MiB a call (see the issue 3 notes); this joins what is staged.
set -euo pipefail
STAGE=${STAGE:-/tmp/stage}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$STAGE"/faiss_gpu-*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/cudart12 "$STAGE"/nvidia_cuda_runtime_cu12-*.whl
CUBLAS13=$(dirname "$(find /opt /usr -name 'libcublas.so.13' 2>/dev/null | head -1)")
CUDART12=/tmp/cudart12/nvidia/cuda_runtime/lib
# faiss-gpu 1.15 preloads CUDA 12 libs from nvidia.<component>/lib: cudart 12, the cuBLAS
# shim, and curand (libcurand.so.10 in CUDA 13 too).
NV=$(dirname "$(dirname "$CUBLAS13")")
mkdir -p "$NV"/cuda_runtime/lib "$NV"/cublas/lib "$NV"/curand/lib
ln -sf "$CUDART12"/libcudart.so.12 "$NV"/cuda_runtime/lib/
ln -sf "$STAGE"/libcublas.so.12 "$STAGE"/libcublasLt.so.12 "$NV"/cublas/lib/
ln -sf "$CUBLAS13"/libcurand.so.10 "$NV"/curand/lib/
export LD_LIBRARY_PATH=$STAGE:$CUDART12:$CUBLAS13:${LD_LIBRARY_PATH:-}
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 benchmarks/gpu_check.py --n "${N:-1000000}" --queries "${QUERIES:-50000}" --model-path "$STAGE"/model --progress "${OUT:-/tmp}/partial.json"
