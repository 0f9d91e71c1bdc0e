#!/usr/bin/env bash
# Base images for docker-compose.yml where no container registry can be reached (CI, air-gapped boxes).
# Run as root, against the engine in DOCKER_HOST (infra/docker-engine.sh starts one). Idempotent: an image
# that exists already is kept (RS_REBUILD_BASE=1 rebuilds them).
#
#   1. local/debian-base:bookworm  debootstrap --variant=minbase bookworm from the machine's apt mirror, imported
#   2. python:3.11-slim             Debian's Python 3.11 on it (compose/offline/python.Dockerfile); the role
#                                   images' default PYTHON_IMAGE, so `docker compose build` pulls nothing
#   3. redis:7.0                    Debian's redis-server 7.0 on it (compose/offline/redis.Dockerfile); the
#                                   compose file's redis image
#
# These names are the public images' names on purpose: with a registry nothing here is needed and
# compose uses the official images; without one, the local images stand in for them. The images only
# need Debian's apt mirror (plain http), reached from the build containers over the default bridge.
#
# It also stages what the role images copy in from the machine (compose/context/, git-ignored):
# the CA bundle pip must trust (the machine's pip `cert`, or PIP_CERT) and the torch CPU wheel from
# the machine's local wheel folder (pip's `find-links`, or PIP_FIND_LINKS) when there is one.
#
# Settings (environment): RS_DEBOOTSTRAP_DIR (where the rootfs is made, /var/lib/rollstream-docker/rootfs),
# RS_APT_MIRROR (default: the machine's Debian mirror), RS_REBUILD_BASE=1.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "offline-base: $*" >&2; }
has_image() { docker image inspect "$1" >/dev/null 2>&1; }
rebuild=${RS_REBUILD_BASE:-0}

docker info >/dev/null 2>&1 || { say "no Docker engine answers (DOCKER_HOST=${DOCKER_HOST:-unset}); run infra/docker-engine.sh"; exit 1; }

# The Debian mirror apt uses on this machine: the first enabled bookworm source that is not security.
apt_mirror() {
  local m=""
  if compgen -G "/etc/apt/sources.list.d/*.sources" >/dev/null; then
    m=$(awk 'BEGIN { RS = "" } /Types:[^\n]*deb/ && /Suites:[^\n]*bookworm/ && !/Suites:[^\n]*security/ && !/Enabled: *no/ {
               if (match($0, /URIs: *[^ \n]+/)) { split(substr($0, RSTART, RLENGTH), a, / +/); print a[2]; exit } }' \
        /etc/apt/sources.list.d/*.sources)
  fi
  if [ -z "$m" ] && [ -f /etc/apt/sources.list ]; then
    m=$(awk '$1 == "deb" && $3 ~ /^bookworm/ && $3 !~ /security/ { print $2; exit }' /etc/apt/sources.list)
  fi
  echo "${m:-http://deb.debian.org/debian}"
}
security_mirror() {
  local m=""
  if compgen -G "/etc/apt/sources.list.d/*.sources" >/dev/null; then
    m=$(awk 'BEGIN { RS = "" } /Suites:[^\n]*bookworm-security/ && !/Enabled: *no/ {
               if (match($0, /URIs: *[^ \n]+/)) { split(substr($0, RSTART, RLENGTH), a, / +/); print a[2]; exit } }' \
        /etc/apt/sources.list.d/*.sources)
  fi
  echo "${m:-http://deb.debian.org/debian-security}"
}

# 1. Debian base from the apt mirror.
if [ "$rebuild" = 1 ] || ! has_image local/debian-base:bookworm; then
  command -v debootstrap >/dev/null || { apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap; }
  mirror=${RS_APT_MIRROR:-$(apt_mirror)}
  security=$(security_mirror)
  rootfs=${RS_DEBOOTSTRAP_DIR:-/var/lib/rollstream-docker/rootfs}
  rm -rf "$rootfs"
  mkdir -p "$rootfs"
  say "debootstrap --variant=minbase bookworm from $mirror"
  debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 \
    || { tail -n 20 "$rootfs.log" >&2; exit 1; }
  cat >"$rootfs/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb $security bookworm-security main
EOF
  # As in Debian's own images: no docs or man pages from later installs, no apt caches.
  cat >"$rootfs/etc/dpkg/dpkg.cfg.d/excludes" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
EOF
  echo 'APT::Install-Recommends "false";' >"$rootfs/etc/apt/apt.conf.d/99no-recommends"
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
  say "docker import local/debian-base:bookworm"
  tar -C "$rootfs" -c . | docker import --change 'CMD ["bash"]' --change 'ENV LANG=C.UTF-8' \
    - local/debian-base:bookworm >/dev/null
  rm -rf "$rootfs"
else
  say "local/debian-base:bookworm exists"
fi

# 2. and 3. The stand-ins for the official images (the legacy builder: nothing to pull, no buildx needed).
build_base() {  # TAG DOCKERFILE
  if [ "$rebuild" = 1 ] || ! has_image "$1"; then
    say "building $1"
    DOCKER_BUILDKIT=0 docker build -q -t "$1" -f "$2" compose/offline >/dev/null
  else
    say "$1 exists"
  fi
}
build_base python:3.11-slim compose/offline/python.Dockerfile
build_base redis:7.0 compose/offline/redis.Dockerfile

# What the role images copy in from this machine (compose/context/ is git-ignored but for its README).
pip_config() { python3 -m pip config get "global.$1" 2>/dev/null || true; }
mkdir -p compose/context/wheels
cert=${PIP_CERT:-$(pip_config cert)}
if [ -n "$cert" ] && [ -f "$cert" ]; then
  cmp -s "$cert" compose/context/ca-certificates.crt || cp "$cert" compose/context/ca-certificates.crt
  say "staged the CA bundle pip trusts ($cert)"
fi
for links in ${PIP_FIND_LINKS:-} $(pip_config find-links); do
  for wheel in "${links#file://}"/torch-2.13.0+cpu-cp311-*.whl; do
    [ -f "$wheel" ] || continue
    target=compose/context/wheels/$(basename "$wheel")
    [ -f "$target" ] || { cp "$wheel" "$target"; say "staged $(basename "$wheel")"; }
  done
done
say "done: $(docker images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^(local/debian-base|python|redis):' | tr '\n' ' ')"
