"""The LMDB backend: a store in one LMDB environment on disk (lmdb.store.LmdbStore)."""
