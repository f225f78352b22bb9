"""The generated page of what each store backend can do, from the backends' own declarations."""

from __future__ import annotations

from cache_service.core.store.protocols import BEHAVIOURS, Capabilities
from cache_service.core.store.registry import BACKENDS
from cache_service.tools.reference_markdown import code, page, prose, table

INTRO = (
    "Each store backend declares the behaviours it lacks, with the reason, in its store "
    "class's `capabilities` (`cache_service/core/store/protocols.py`). Start-up refuses "
    "settings a backend cannot honour, capacity enforcement leaves a backend that evicts on "
    "its own alone, the operator routes answer `501` (problem type `not-supported-by-store`) "
    "for a control it lacks, and the contract suite expects each backend to pass exactly "
    "the tests of what it declares. This table is that declaration."
)


def backends_page() -> str:
    """Every behaviour, and whether each backend (by URL scheme) has it, or why not."""
    schemes: dict[str, list[str]] = {}  # by backend name, the URL schemes that open it
    declared_by: dict[str, Capabilities] = {}
    for scheme, entry in BACKENDS.items():
        declared = entry.store_class.capabilities
        declared_by[declared.backend] = declared
        schemes.setdefault(declared.backend, []).append(f"{scheme}://")
    header = ["behaviour", "what it means"]
    header += [prose(f"{backend} ({', '.join(names)})") for backend, names in schemes.items()]
    rows = []
    for name, meaning in BEHAVIOURS.items():
        cells = [code(name), prose(meaning)]
        for declared in declared_by.values():
            cells.append("yes" if declared.has(name) else prose("no: " + declared.why_not(name)))
        rows.append(cells)
    return page("Store backends", INTRO, table(header, rows))
