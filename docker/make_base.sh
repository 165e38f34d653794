#!/usr/bin/env bash
# Build a stand-in for the official PyTorch base image without an image registry (air-gapped clusters).
#
#   docker/make_base.sh [TAG]                      # default TAG: polyattn-base:torch2.14.1
#   DEBIAN_MIRROR=http://mirror.example/debian TORCH=2.14.1 TORCHVISION=0.29.1 docker/make_base.sh
#   docker build -f docker/Dockerfile --build-arg BASE_IMAGE=polyattn-base:torch2.14.1 -t polyattn-lightning .
#
# Needs root (debootstrap), debootstrap, a Docker engine, a Debian mirror (default: the first deb URI in
# /etc/apt/sources.list*, else deb.debian.org) and the package index for torch. Extra CA certificates in
# docker/ca-certificates/*.crt are trusted by pip inside the build.
set -euo pipefail

tag=${1:-polyattn-base:torch2.14.1}
here=$(cd "$(dirname "$0")" && pwd)
mirror=${DEBIAN_MIRROR:-$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
    | grep -oE '^(URIs:|deb) +https?://[^ ]+' | grep -v security | awk '{print $2}' | head -n 1 || true)}
mirror=${mirror:-http://deb.debian.org/debian}
rootfs=$(mktemp -d /tmp/polyattn-rootfs.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT

echo "debootstrap bookworm from $mirror"
debootstrap --variant=minbase bookworm "$rootfs" "$mirror" > "$rootfs.log" 2>&1 || { tail -n 20 "$rootfs.log"; exit 1; }
rm -f "$rootfs.log"
tar -C "$rootfs" -c . | docker import - polyattn-rootfs:bookworm
docker build -f "$here/base.Dockerfile" -t "$tag" \
    --build-arg TORCH="${TORCH:-2.14.1}" --build-arg TORCHVISION="${TORCHVISION:-0.29.1}" "$here"
echo "built $tag"
