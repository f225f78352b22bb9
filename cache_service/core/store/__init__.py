"""Block stores: what a store is (protocols.py: its roles and each backend's declared
capabilities), registry.py (a store by URL), the parts written once over a backend's
transaction (parts/), and the backends (memory.py, lmdb/, redis/)."""
