# cp-infer on a CUDA host: one container, one node, N GPUs (set NPROC to the GPU count).
# Run it with --ipc=host (or --shm-size 16g): NCCL moves data between the ranks through /dev/shm, and Docker's
# 64 MB default fails the group's first collectives. docs/deployment.md#docker has the full command.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    CP_INFER_CACHE=/data/cache NPROC=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv ffmpeg \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /app
COPY pyproject.toml README.md ./
COPY cp_infer ./cp_infer
COPY models ./models
COPY server ./server
RUN pip install --index-url https://download.pytorch.org/whl/cu128 torch && pip install .

EXPOSE 8000
VOLUME ["/data", "/models"]
# torchrun starts the worker group; rank 0 serves HTTP. Mount a diffusers folder at /models/ltx and add
# `--model /models/ltx` to serve it instead of the embedded default.
CMD ["sh", "-c", "torchrun --nproc_per_node ${NPROC} -m server.cli serve --host 0.0.0.0 --port 8000 --data-dir /data"]
