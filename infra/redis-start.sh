#!/bin/sh
# Starts the compose deployment's Redis with one ACL user per service (docker-compose.yml runs it):
# the users and their rights come from redis-users.acl beside this script, each user's password from
# RS_REDIS_PASSWORD_<USER> (its name in capitals, - as _). The ACL file Redis reads holds SHA-256
# hashes only, in the container's /tmp, readable by Redis alone; the default user may only PING.
#   sh redis-start.sh /usr/local/etc/redis/redis.conf
set -eu
conf=${1:?usage: redis-start.sh REDIS_CONF}
users=${RS_REDIS_USERS_FILE:-$(dirname "$0")/redis-users.acl}
acl=$(mktemp "${TMPDIR:-/tmp}/redis-users.XXXXXX")
trap 'rm -f "$acl"' EXIT  # on a failure; exec below replaces the shell without running it
echo "user default on nopass resetkeys resetchannels -@all +ping" > "$acl"
while read -r name rights; do
  case "$name" in '' | '#'*) continue ;; esac
  case "$name" in *[!a-z0-9-]*) echo "redis-start.sh: bad user name '$name' in $users" >&2; exit 1 ;; esac
  var=RS_REDIS_PASSWORD_$(printf %s "$name" | tr 'a-z-' 'A-Z_')
  eval "password=\${$var:-}"
  if [ -z "$password" ]; then
    echo "redis-start.sh: $var is not set (the password of Redis user $name; infra/redis-passwords.sh makes them)" >&2
    exit 1
  fi
  echo "user $name on #$(printf %s "$password" | sha256sum | cut -d' ' -f1) $rights" >> "$acl"
  unset "$var"
done < "$users"
unset password
# The official image's entrypoint drops root for the redis user (and owns /data for it); the offline
# stand-in already runs as redis.
if [ "$(id -u)" = 0 ] && id redis > /dev/null 2>&1; then chown redis "$acl"; fi
if command -v docker-entrypoint.sh > /dev/null; then
  exec docker-entrypoint.sh redis-server "$conf" --aclfile "$acl"
fi
exec redis-server "$conf" --aclfile "$acl"
