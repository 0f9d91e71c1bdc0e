#!/bin/sh
# A new random password for every Redis user of the compose deployment (infra/redis-users.acl), as the
# lines of an env file that docker compose reads (the compose file asks for each one):
#   infra/redis-passwords.sh > .env && chmod 600 .env
set -eu
users=${RS_REDIS_USERS_FILE:-$(dirname "$0")/redis-users.acl}
while read -r name _rights; do
  case "$name" in '' | '#'*) continue ;; esac
  printf 'RS_REDIS_PASSWORD_%s=%s\n' "$(printf %s "$name" | tr 'a-z-' 'A-Z_')" \
    "$(od -An -tx1 -N24 /dev/urandom | tr -d ' \n')"
done < "$users"
