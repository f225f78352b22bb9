"""The Redis backend: a store on a Redis Cluster or one node (redis.store.RedisStore)."""
