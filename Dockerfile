# fsdp-train in a container: CUDA PyTorch, torch and Lightning pinned (within pyproject's bounds;
# tests/test_docs.py checks that they agree), the package installed, a non-root user.
#
#   docker build -t fsdp-cli .
#   docker run --gpus all --ipc=host -v $PWD/outputs:/workspace/outputs fsdp-cli recipe=llama_124m_fsdp2
#
# The base image's torch is the pinned one, so pip keeps it instead of downloading another build.
ARG TORCH_VERSION=2.9.0
ARG CUDA_TAG=cuda12.8-cudnn9-runtime
FROM pytorch/pytorch:${TORCH_VERSION}-${CUDA_TAG}

ARG TORCH_VERSION
ARG LIGHTNING_VERSION=2.6.6
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/fsdp_cli
COPY . .
# The plot extra draws sweep_summary.png; the --cfg check proves the configs shipped inside the
# package (it runs from /, away from the source tree).
RUN pip install "torch==${TORCH_VERSION}" "lightning==${LIGHTNING_VERSION}" ".[plot]" \
    && cd / && fsdp-train --cfg job > /dev/null && fsdp-recipe ls > /dev/null

RUN useradd --create-home --uid 1000 trainer \
    && mkdir -p /workspace && chown trainer:trainer /workspace
USER trainer
WORKDIR /workspace
ENTRYPOINT ["fsdp-train"]
