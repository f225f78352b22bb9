"""The parts of a store written once over any backend's transaction (store.parts.backend):
data path, evictions, operator controls, repairs, the record codec and the indexes."""
