#!/usr/bin/env bash
# Build the image from docker/Dockerfile and run it the ways docs/howto/docker.md documents, on CPU:
#   1. the classification quickstart with --network none, as the image's non-root user, its run folder
#      on a mounted host folder that the host user can read;
#   2. a 2-process DDP job inside one container (--ipc=host);
#   3. a 2-node job as two containers on a user-defined Docker network (torchrun, c10d rendezvous), killed
#      after its first last.ckpt and resumed in fresh containers: bitwise equal to an uninterrupted one.
#
#   docker/check.sh [--base IMAGE] [--ca-certs DIR] [--tag TAG] [--work DIR] [--no-build]
#
#   --base IMAGE    the base image (default: the Dockerfile's, the official pytorch/pytorch image); without a
#                   registry make one with docker/make_base.sh and pass --base polyattn-base:torch2.14.1
#   --ca-certs DIR  extra CA certificates (*.crt) the build's downloads need (a TLS-intercepting proxy's);
#                   copied into the git-ignored docker/ca-certificates/
#   --work DIR      where the runs go (default: a new folder under /tmp); kept afterwards
# Run from anywhere, by a user who may run docker. Exits non-zero at the first failed check.
# tests/cluster/test_docker.py runs it under the opt-in pytest marker `docker` (pytest -m docker).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
tag=polyattn-lightning:check
base=""
certs=""
work=""
build=1
while [ $# -gt 0 ]; do
    case $1 in
        --base) base=$2; shift 2 ;;
        --ca-certs) certs=$2; shift 2 ;;
        --tag) tag=$2; shift 2 ;;
        --work) work=$2; shift 2 ;;
        --no-build) build=0; shift ;;
        *) echo "docker/check.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
work=${work:-$(mktemp -d /tmp/polyattn-docker-check.XXXXXX)}
mkdir -p "$work"
# the image's user gets the host user's uid, so the host user owns what it writes (never uid 0: that is root)
uid=$(id -u)
[ "$uid" = 0 ] && uid=1000
net=polyattn-check-$$
cleanup() {
    docker rm -f "$net-node0" "$net-node1" > /dev/null 2>&1 || true
    docker network rm "$net" > /dev/null 2>&1 || true
}
trap cleanup EXIT
step() { echo; echo "== $*"; }
folder() {  # a host folder the container user can write to
    mkdir -p "$work/$1"
    [ "$(id -u)" = 0 ] && chown "$uid" "$work/$1"
    echo "$work/$1"
}

if [ "$build" = 1 ]; then
    step "build $tag${base:+ on $base}"
    if [ -n "$certs" ]; then
        cp "$certs"/*.crt "$repo/docker/ca-certificates/"
    fi
    start=$(date +%s)
    docker build -f "$repo/docker/Dockerfile" ${base:+--build-arg BASE_IMAGE="$base"} --build-arg UID="$uid" \
        -t "$tag" "$repo"
    echo "build time: $(( $(date +%s) - start )) s"
fi
echo "image size: $(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.2f GB", $1 / 1e9}')"

# CPU runs: few steps, no progress bar, deterministic (the bitwise comparison needs it)
cpu=(--trainer.accelerator cpu --trainer.enable_progress_bar false --trainer.deterministic true)
# two processes share the host's cores: one intra-op thread each, else their thread pools spin-wait on each other
one_thread=(-e OMP_NUM_THREADS=1)

step "quickstart, --network none, as the image's user"
user=$(docker run --rm --network none --entrypoint id "$tag" -u)
[ "$user" != 0 ] || { echo "the image runs as root"; exit 1; }
echo "container user: uid $user"
out=$(folder quickstart)
start=$(date +%s)
docker run --rm --network none -v "$out:/workspace/runs" "$tag" \
    fit --config configs/classification/quickstart.yaml "${cpu[@]}"
echo "quickstart: $(( $(date +%s) - start )) s"
last=$(find "$out" -name last.ckpt | head -n 1)
[ -n "$last" ] || { echo "no last.ckpt under $out"; exit 1; }
unreadable=$(find "$out" ! -readable | head -n 5)
[ -z "$unreadable" ] || { echo "the host user cannot read: $unreadable"; exit 1; }
echo "run folder on the host: $(dirname "$(dirname "$last")") (owner uid $(stat -c %u "$last"))"

step "2-process DDP in one container (--ipc=host)"
out=$(folder ddp)
# without a network the container's host name does not resolve: rendezvous and gloo on the loopback device
docker run --rm --network none --ipc=host "${one_thread[@]}" -e GLOO_SOCKET_IFNAME=lo -v "$out:/workspace/runs" --entrypoint torchrun "$tag" \
    --nnodes 1 --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29500 -m polyattn_lightning fit --config configs/classification/quickstart.yaml \
    "${cpu[@]}" --trainer.devices 2 --trainer.strategy ddp --trainer.max_epochs 2
find "$out" -name last.ckpt | grep -q . || { echo "the DDP job wrote no last.ckpt"; exit 1; }

# two containers = two nodes: torchrun on each, c10d rendezvous at node 0's name on the Docker network
docker network create "$net" > /dev/null
two_nodes() {  # two_nodes RUN_FOLDER DETACH [fit arguments...]: both nodes' containers; waits unless DETACH
    local out=$1 detach=$2 node pids=()
    shift 2
    for node in 0 1; do
        docker run --rm ${detach:+-d} --name "$net-node$node" --network "$net" --ipc=host "${one_thread[@]}" -e GLOO_SOCKET_IFNAME=eth0 \
            -v "$out:/workspace/runs" --entrypoint torchrun "$tag" \
            --nnodes 2 --nproc_per_node 1 --node_rank "$node" --rdzv_backend c10d --rdzv_id check \
            --rdzv_endpoint "$net-node0:29500" \
            -m polyattn_lightning fit --config configs/classification/quickstart.yaml "${cpu[@]}" \
            --trainer.devices 1 --trainer.num_nodes 2 --trainer.strategy ddp --trainer.max_epochs 3 "$@" \
            > "$out/node$node.log" 2>&1 &
        pids+=($!)
    done
    for node in 0 1; do
        wait "${pids[$node]}" || { echo "node $node failed:"; tail -n 30 "$out/node$node.log"; exit 1; }
    done
}

step "2-node job, uninterrupted"
reference=$(folder two_nodes_reference)
start=$(date +%s)
two_nodes "$reference" ""
echo "2-node job: $(( $(date +%s) - start )) s"
grep -h "distributed_backend\|All distributed processes" "$reference"/node0.log | head -n 3 || true

step "2-node job, killed after its first last.ckpt, resumed in fresh containers"
stopped=$(folder two_nodes_stopped)
two_nodes "$stopped" 1
until find "$stopped" -name last.ckpt | grep -q .; do
    docker inspect "$net-node0" > /dev/null 2>&1 || { echo "node 0 ended before a checkpoint"; exit 1; }
    sleep 0.5
done
docker kill "$net-node0" "$net-node1" > /dev/null
docker wait "$net-node0" "$net-node1" > /dev/null 2>&1 || true
first=$(find "$stopped" -name last.ckpt | head -n 1)
cp "$first" "$work/killed_at.ckpt"
chmod a+r "$work/killed_at.ckpt"
rel=${first#"$stopped"/}
two_nodes "$stopped" "" --ckpt_path "/workspace/runs/$rel"

step "compare the final checkpoints"
ref_last=$(find "$reference" -name last.ckpt | head -n 1)
resumed_last=$(find "$stopped" -name last.ckpt -newer "$work/killed_at.ckpt" | head -n 1)
docker run --rm -i --network none -v "$work:/work:ro" --entrypoint python "$tag" - \
    "/work/${ref_last#"$work"/}" "/work/${resumed_last#"$work"/}" "/work/killed_at.ckpt" <<'EOF'
import sys, torch
ref, resumed, killed = (torch.load(p, weights_only=True) for p in sys.argv[1:])
print(f"killed at step {killed['global_step']}; reference and resumed runs end at {ref['global_step']} / {resumed['global_step']}")
assert 0 < killed["global_step"] < ref["global_step"] == resumed["global_step"]
def same(a, b, path):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a: same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)): same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
for key in ("state_dict", "optimizer_states", "lr_schedulers", "rng_states"):
    same(ref[key], resumed[key], key)
print("weights, optimizer, lr schedule and both ranks' RNG states: bitwise equal")
EOF
echo; echo "docker/check.sh: all checks passed (runs in $work)"
