# fsdp-train in a container with CUDA PyTorch:
#   docker build -t fsdp-cli . && docker run --gpus all --ipc=host fsdp-cli recipe=llama_124m_fsdp2
FROM pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime
WORKDIR /opt/fsdp_cli
COPY . .
# The image's torch satisfies torch>=2.6, so pip keeps it. The --cfg check proves the configs
# shipped inside the wheel.
RUN pip install --no-cache-dir . && cd / && fsdp-train --cfg job > /dev/null
WORKDIR /workspace
ENTRYPOINT ["fsdp-train"]
