#!/bin/sh
# Starts one Redis Cluster node: redis.conf plus what only the pod knows, written to a
# memory-backed folder (the password never lands on the volume nor in the process list).
#   MEMORY_LIMIT_BYTES  the container's memory limit (the Downward API)
#   MAXMEMORY_PERCENT   the share of it Redis may fill with keys
#   REDIS_HOSTNAME      this node's DNS name (pod.headless-service)
#   REDIS_PASSWORD      from the Secret: hex or other text without quotes and backslashes
set -eu

case "$REDIS_PASSWORD" in
  "" | *\"* | *\\* | *"
"*)
    echo "start.sh: REDIS_PASSWORD is empty or holds a quote, backslash or newline" >&2
    exit 1
    ;;
esac

# maxmemory counts the keys only: replication and client buffers, fragmentation and the
# fork of a replica's full sync come on top, hence the headroom below the limit.
maxmemory=$((MEMORY_LIMIT_BYTES / 100 * MAXMEMORY_PERCENT))

umask 077
{
  cat /etc/redis/redis.conf
  echo "maxmemory $maxmemory"
  echo "cluster-announce-hostname $REDIS_HOSTNAME"
  echo "requirepass \"$REDIS_PASSWORD\""
  echo "masterauth \"$REDIS_PASSWORD\""
} >/run/redis/redis.conf

# A pod comes back with a new IP; nodes.conf remembers the others' old ones. Each line
# carries the node's DNS name (ip:port@bus,hostname): point it at where that name resolves
# now. Names not resolvable yet keep their IP; those nodes correct it when they start and
# reach this one.
nodes=/data/nodes.conf
if [ -s "$nodes" ]; then
  for host in $(sed -n 's/^[^ ]* [^ ,]*,\([^ ,]*\) .*/\1/p' "$nodes"); do
    ip=$(getent ahostsv4 "$host" | head -n 1 | cut -d ' ' -f 1) || ip=""
    if [ -n "$ip" ]; then
      sed -i "s/^\([^ ]*\) [^ :]*:\([0-9]*@[0-9]*\),$host /\1 $ip:\2,$host /" "$nodes"
    fi
  done
fi

exec redis-server /run/redis/redis.conf
