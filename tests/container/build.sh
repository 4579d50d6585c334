#!/usr/bin/env bash
# Builds the CPU image as an operator would, with a real container runtime and no image registry:
# podman on a base made here from Debian's packages (kept in podman's store between runs, rebuilt
# only when missing), pip inside the build configured from this machine's own pip configuration.
# Usage: IMAGE=name BASE=name bash tests/container/build.sh   (CONTAINERS_CONF set by the Makefile)
set -euo pipefail
cd "$(dirname "$0")/../.."
IMAGE=${IMAGE:?IMAGE names the image to build}
BASE=${BASE:?BASE names the local Debian base image}
PY=${PY:-python3}

install_tools() {
    local missing=()
    for tool in podman runc mmdebstrap; do command -v "$tool" >/dev/null || missing+=("$tool"); done
    [ ${#missing[@]} -eq 0 ] && return
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        echo "container-test needs ${missing[*]} (Debian: apt-get install podman runc mmdebstrap)" >&2
        exit 1
    fi
    echo "container-test: installing ${missing[*]}"
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc mmdebstrap
}

# The first existing folder among pip's find-links: where a local CPU torch wheel would be.
wheel_folder() {
    local links
    links=${PIP_FIND_LINKS:-$("$PY" -m pip config get global.find-links 2>/dev/null || true)}
    for link in $links; do [ -d "$link" ] && { echo "$link"; return; }; done
}

# minbase Debian with python3 and venv. Its /etc/pip.conf makes pip inside the build trust the CA
# bundle pip trusts here (a TLS-intercepting proxy needs it) and look in /wheels, mounted at build time.
build_base() {
    local conf cert hooks=()
    conf=$(mktemp -d)
    trap 'rm -rf "$conf"' RETURN
    printf '[global]\nfind-links = /wheels\n' >"$conf/pip.conf"
    cert=${PIP_CERT:-$("$PY" -m pip config get global.cert 2>/dev/null || true)}
    if [ -f "$cert" ]; then
        printf 'cert = /etc/ssl/certs/host-ca.crt\n' >>"$conf/pip.conf"
        hooks+=(--customize-hook="upload $cert /etc/ssl/certs/host-ca.crt")
    fi
    hooks+=(--customize-hook='mkdir -p "$1/wheels"' --customize-hook="upload $conf/pip.conf /etc/pip.conf")
    mmdebstrap --quiet --variant=minbase --include=python3,python3-venv "${hooks[@]}" bookworm - \
        | podman import --quiet - "$BASE" >/dev/null
}

install_tools
podman image exists "$BASE" || { echo "container-test: building $BASE from Debian's packages"; build_base; }
wheels=$(wheel_folder)
mounts=()
[ -n "$wheels" ] && mounts=(-v "$wheels:/wheels:ro")
podman build --format docker --network host --build-arg FLAVOUR=cpu --build-arg CPU_BASE="$BASE" \
    ${TORCH_INDEX:+--build-arg TORCH_INDEX="$TORCH_INDEX"} "${mounts[@]}" -t "$IMAGE" .
