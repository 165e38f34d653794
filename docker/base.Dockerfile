# A stand-in for the official PyTorch image, made without an image registry (docker/make_base.sh):
# a debootstrapped Debian bookworm root file system (imported as ROOTFS), its python 3.11, and torch
# and torchvision from the package index in a virtual environment that is first on PATH, as conda
# is in pytorch/pytorch. docker/Dockerfile then builds on it unchanged (--build-arg BASE_IMAGE=...).
ARG ROOTFS=polyattn-rootfs:bookworm
FROM ${ROOTFS}
ARG TORCH=2.14.1
ARG TORCHVISION=0.29.1
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
COPY ca-certificates/ /usr/local/share/ca-certificates/extra/
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && update-ca-certificates \
 && python3 -m venv /opt/venv \
 && PIP_CERT=/etc/ssl/certs/ca-certificates.crt pip install "torch==${TORCH}" "torchvision==${TORCHVISION}" \
 && python -c "import torch, torchvision; print(torch.__version__, torchvision.__version__)"
