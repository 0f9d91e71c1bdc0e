#!/bin/sh
# Makes what the manifests name but cannot hold, in their namespace (rollstream; RS_K8S_NAMESPACE for an
# overlay that sets another), before `kubectl apply -k infra/k8s/overlays/<overlay>`:
#   ConfigMap rollstream-redis          infra/redis.conf, redis-start.sh and redis-users.acl, the files
#                                       compose mounts (kustomize reads no file outside its folder); replaced
#                                       each run
#   Secret rollstream-redis-passwords   a password per Redis user (infra/redis-passwords.sh, compose's .env):
#                                       made once, kept after; a user added to the ACL gets one added
#   Secret rollstream-run-env           compose/run.env (or the file RS_ENV_FILE names), given a fresh
#                                       RS_SECURITY__HTTP_TOKEN when it sets none: made once. kubectl takes
#                                       each value as written, so write them unquoted.
#   infra/k8s/setup.sh
set -eu
ns=${RS_K8S_NAMESPACE:-rollstream}
infra=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

kubectl get namespace "$ns" >/dev/null 2>&1 || kubectl create namespace "$ns"

kubectl -n "$ns" create configmap rollstream-redis --from-file="$infra/redis.conf" \
  --from-file="$infra/redis-start.sh" --from-file="$infra/redis-users.acl" --dry-run=client -o yaml |
  kubectl -n "$ns" apply -f -

# Passwords stay as they are once made: Redis's services all hold them.
sh "$infra/redis-passwords.sh" > "$tmp/passwords.env"
if ! kubectl -n "$ns" get secret rollstream-redis-passwords >/dev/null 2>&1; then
  kubectl -n "$ns" create secret generic rollstream-redis-passwords --from-env-file="$tmp/passwords.env"
else
  while IFS='=' read -r key value; do
    if [ -z "$(kubectl -n "$ns" get secret rollstream-redis-passwords -o "jsonpath={.data.$key}")" ]; then
      kubectl -n "$ns" patch secret rollstream-redis-passwords --type merge \
        -p "{\"stringData\": {\"$key\": \"$value\"}}"
    fi
  done < "$tmp/passwords.env"
fi

if ! kubectl -n "$ns" get secret rollstream-run-env >/dev/null 2>&1; then
  env_file=${RS_ENV_FILE:-$infra/../compose/run.env}
  if [ -f "$env_file" ]; then cp "$env_file" "$tmp/run.env"; else : > "$tmp/run.env"; fi
  # the services listen on the cluster's network: their routes ask for a token
  grep -q '^RS_SECURITY__HTTP_TOKEN=.' "$tmp/run.env" ||
    echo "RS_SECURITY__HTTP_TOKEN=$(od -An -tx1 -N24 /dev/urandom | tr -d ' \n')" >> "$tmp/run.env"
  kubectl -n "$ns" create secret generic rollstream-run-env --from-env-file="$tmp/run.env"
fi
