#!/bin/sh
# Forms the Redis Cluster once: waits until every node answers, then
# `redis-cli --cluster create NODES --cluster-replicas 1 --cluster-yes`. Does nothing when
# the nodes already form a cluster; fails (for a person to look) when they form part of one.
#   REDIS_NODES     every node, HOST:PORT separated by spaces (three primaries, three replicas)
#   REDIS_PASSWORD  from the Secret (redis-cli reads it from REDISCLI_AUTH, not argv)
#   WAIT_SECONDS    how long to wait for the nodes and for the cluster to be ok (default 600)
set -eu
export REDISCLI_AUTH="$REDIS_PASSWORD"
wait_seconds=${WAIT_SECONDS:-600}

ask() { # ask HOST:PORT COMMAND...: the node's answer, carriage returns dropped
  node=$1
  shift
  redis-cli -h "${node%:*}" -p "${node##*:}" "$@" 2>/dev/null | tr -d '\r'
}

field() { # field NAME: the value of NAME:value in the text on stdin
  sed -n "s/^$1://p"
}

count=$(($(echo $REDIS_NODES | wc -w)))

all_ok() { # whether every node reports cluster_state:ok and knows every other node
  for node in $REDIS_NODES; do
    info=$(ask "$node" cluster info)
    [ "$(echo "$info" | field cluster_state)" = ok ] || return 1
    [ "$(echo "$info" | field cluster_known_nodes)" = "$count" ] || return 1
  done
}

waited=0
for node in $REDIS_NODES; do
  until [ "$(ask "$node" ping)" = PONG ]; do
    if [ "$waited" -ge "$wait_seconds" ]; then
      echo "create-cluster: $node does not answer after ${wait_seconds}s" >&2
      exit 1
    fi
    echo "create-cluster: waiting for $node"
    sleep 2
    waited=$((waited + 2))
  done
done

# A node that knows others or serves slots is already in a cluster.
member=""
for node in $REDIS_NODES; do
  info=$(ask "$node" cluster info)
  known=$(echo "$info" | field cluster_known_nodes)
  assigned=$(echo "$info" | field cluster_slots_assigned)
  if [ "${known:-1}" != 1 ] || [ "${assigned:-0}" != 0 ]; then
    member="$member $node"
  fi
done

if [ -z "$member" ]; then
  # shellcheck disable=SC2086 # one argument per node
  redis-cli --cluster create $REDIS_NODES --cluster-replicas 1 --cluster-yes
elif [ "$(echo $member)" != "$(echo $REDIS_NODES)" ]; then
  echo "create-cluster: only$member are in a cluster; check it by hand" \
    "(redis-cli --cluster check), this Job does not repair" >&2
  exit 1
else
  echo "create-cluster: the nodes already form a cluster; nothing to do"
fi

waited=0
until all_ok; do
  if [ "$waited" -ge "$wait_seconds" ]; then
    echo "create-cluster: the cluster is not ok after ${wait_seconds}s" >&2
    exit 1
  fi
  sleep 1
  waited=$((waited + 1))
done
echo "create-cluster: cluster_state:ok on every node, and each knows all $count"
