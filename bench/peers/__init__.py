"""Peers and physical floors for the payload scenario (issue 4, scenario 3).

Each module exposes `measure(*, quick, repetitions, allow_install) -> list[Row]`:
`redis_peer`, `lmcache_peer` and `mooncake_peer` (peers a user might pick instead of us),
`lmdb_floor` (the storage floor) and `tcp_floor` (the network floor). `payloads` is the
shared workload and `harness` the timing, row and process helpers they share.
"""

PEER_MODULES = (
    "bench.peers.redis_peer",
    "bench.peers.lmcache_peer",
    "bench.peers.mooncake_peer",
    "bench.peers.lmdb_floor",
    "bench.peers.tcp_floor",
)
