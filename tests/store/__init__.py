"""The store contract, grouped by capability, over every backend (the `store` fixture);
LMDB-only tests in test_lmdb_only.py."""
