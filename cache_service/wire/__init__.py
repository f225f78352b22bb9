"""The JSON answers the service sends and the client reads, declared once.

`answers.py` declares each data-path answer as a plain dataclass, `reports.py` the service's
reports on itself (/v1/info, /v1/stats); `reader.py` reads decoded JSON into one, checking
every field. The service builds its answers and its OpenAPI document from these
declarations, the client parses with them, so a field added here shows in both. A layer of its
own, below the service and the client, above the core; plain Python (no pydantic or HTTP
library), so the client and the vLLM connector need nothing of the server's.
"""
