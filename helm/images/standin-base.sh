#!/bin/sh
# Builds a stand-in for python:3.11-slim-bookworm from Debian's package mirror, for machines that
# cannot pull from a container registry (the container tests, air-gapped CI): a bookworm minbase
# root filesystem with python3 and a venv at /opt/venv on PATH, committed with buildah. Needs root,
# buildah and mmdebstrap (one apt run with parallel downloads: a third of debootstrap's CPU time).
#   helm/images/standin-base.sh [IMAGE]      (default: localhost/pagoda-standin/python:3.11-slim-bookworm)
# Then pass --build-arg PYTHON_IMAGE=IMAGE (router) or BASE_IMAGE=IMAGE (CPU worker) to the builds.
set -eu
image=${1:-localhost/pagoda-standin/python:3.11-slim-bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

ctr=$(buildah from scratch)
trap 'buildah rm "$ctr" >/dev/null' EXIT
root=$(buildah mount "$ctr")
# No docs, man pages or translations (as in the slim images); unsafe-io: the tree is thrown away
# if the build fails, so dpkg need not fsync every file.
mmdebstrap --mode=root --variant=minbase --include=python3,python3-venv,ca-certificates \
    --dpkgopt=force-unsafe-io --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    bookworm "$root" "$mirror"
chroot "$root" python3 -m venv /opt/venv
buildah config --env PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd python3 "$ctr"
buildah unmount "$ctr" >/dev/null
buildah commit --quiet "$ctr" "$image"
