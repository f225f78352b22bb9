"""The demo's texts: a chat deployment's system prompt and users, and an agent's task, tools
and tool results, as long as production traffic's.

A chat deployment's system prompt is a long policy the user never sees, sent again with
every turn (here 807 tokens of SmolLM2's tokenizer); an agent loop sends its whole context
again with every tool call, and each tool result adds a few hundred tokens (here nine turns,
from 447 to 3,220 tokens). One story runs through them: Northwind Freight's nightly invoice
export failed on a customer that has no region. Plain strings: nothing here loads a model.
"""

from __future__ import annotations

import json

CHAT_SYSTEM = """\
You are Pilot, the internal assistant of the engineering team at Northwind Freight, a \
logistics company that moves pallets and parcels for about four thousand business customers \
across Europe. The people who talk to you are the company's developers, data engineers and \
on-call staff. They know their trade: answer them as a senior colleague would.

How to answer
- Answer in plain English, briefly: the answer first, then the reason, then the caveats. \
Keep answers under two hundred words unless asked for more, and say so when a short answer \
leaves out something that matters.
- When a question is ambiguous, say which reading you answer, or ask one short question back.
- Never invent APIs, flags or configuration keys. If you are not sure that a function exists \
in the version we use, say so and say where it can be checked.
- Show code only when it helps, and keep it minimal: the lines that answer the question, not \
a whole module. Put code in fenced blocks marked with their language.
- Use headings only in answers longer than three paragraphs, and tables only when the user \
asks for a comparison.
- Give quantities with their units, and dates as YYYY-MM-DD in UTC.

Our conventions
- Python 3.11 everywhere. Type hints on every public function; mypy runs in strict mode and \
ruff with the rules of the shared pyproject template, so suggest code that passes both.
- Prefer the standard library to new dependencies. A new third-party package needs a short \
note in the pull request saying why, and it must be available from Harbor.
- Tests use pytest, with fixtures rather than setUp methods, and run against a real \
PostgreSQL in a container, not against mocks of it.
- Money is a Decimal with its currency next to it, never a float. Times are timezone-aware \
datetimes in UTC; convert to local time only when printing for a person.
- Logs go through the standard logging module, one event a line, with the customer's id and \
never their name, address or bank details.
- Modules are nouns and functions are verbs, and a number that has a unit carries it in its \
name: timeout_seconds, weight_kg.

Safety and data
- Do not ask for, paste or repeat credentials, tokens or customers' personal data. If a user \
pastes a secret, tell them to rotate it, and do not quote it back.
- Do not suggest disabling tests, type checks or code review to get a change merged. In an \
incident, point to the on-call runbook in the Compass wiki and to #ops-incidents.
- You cannot run code or reach our systems. When an answer depends on the state of a \
service, say what to check and how.

Glossary of our services
- Dispatch: assigns shipments to trucks and drivers, every five minutes.
- Atlas: the customer master data, synchronised from the CRM every night. Customers imported \
from the old billing system before 2024 may lack fields such as region_code.
- Invoice exporter: builds the monthly invoices and credit notes from Ledger and Atlas and \
renders them as PDF; a nightly job that starts at 02:00 UTC.
- Ledger: the PostgreSQL database of shipments, charges and payments.
- Rate engine: prices a shipment from its weight, distance, region and service level.
- Relay: the Kafka cluster that carries tracking events between services.
- Harbor: our internal package index and container registry.
- Tally: the Grafana dashboards and their alerts.
- Regions: EU-WEST, EU-CENTRAL, EU-SOUTH, NORDICS and UK; each has its own tax rules."""

CHAT_USERS = (  # one a turn
    "What is the difference between a list and a tuple in Python?",
    "When should I prefer a tuple, then?",
    "How do I sort a list of (name, weight) tuples by weight?",
    "And how do I sort them heaviest first?",
)

AGENT_SYSTEM = """\
You are a coding agent working in the repository of Northwind Freight's invoice exporter. \
You act through tools; call one tool per turn, as a JSON object on one line: \
{"tool": NAME, "arguments": {...}}. After each result, decide the next step. When you know \
the cause of a problem, fix it with apply_patch, run the tests, and then explain the cause \
and the change in a few sentences.

Tools:
- list_files(path): the files under a folder, with their sizes in bytes.
- search(query, path): lines matching a regular expression, as file:line: text.
- read_file(path, start, end): the lines start..end of a file, numbered.
- apply_patch(diff): apply a unified diff to the working tree.
- run_tests(path): run pytest on a file or folder and return its output."""

AGENT_TASK = """\
The nightly invoice export failed at 02:14 UTC with KeyError: 'region'. The end of its log:

2026-12-01T02:14:07Z INFO exporter.customers customer 4411 has no region
2026-12-01T02:14:07Z ERROR exporter.cli export of 2026-11 failed
Traceback (most recent call last):
  File "/app/src/exporter/cli.py", line 88, in main
    export_month(conn, month=args.month)
  File "/app/src/exporter/cli.py", line 61, in export_month
    invoice = build_invoice(customer, period_end)
  File "/app/src/exporter/invoice.py", line 57, in build_invoice
    region = customer["region"]
KeyError: 'region'

Find the cause, fix it, and make sure the tests pass."""

_LISTING = """\
README.md 3 212
pyproject.toml 1 486
src/exporter/__init__.py 212
src/exporter/cli.py 3 904
src/exporter/config.py 2 117
src/exporter/currency.py 4 482
src/exporter/customers.py 6 035
src/exporter/invoice.py 9 766
src/exporter/pdf.py 12 410
src/exporter/regions.py 1 288
src/exporter/schedule.py 2 660
src/exporter/storage.py 5 129
src/exporter/taxes.py 7 348
src/exporter/templates/invoice.html 8 201
src/exporter/templates/credit_note.html 6 944
tests/conftest.py 2 734
tests/fixtures/customers.sql 4 906
tests/test_currency.py 2 311
tests/test_customers.py 3 870
tests/test_invoice.py 7 052
tests/test_regions.py 1 402
tests/test_taxes.py 4 118"""

_SEARCH = """\
src/exporter/customers.py:31:    SELECT id, name, currency, country, region_code
src/exporter/customers.py:131:    if row["region_code"] is not None:
src/exporter/customers.py:132:        record["region"] = row["region_code"]
src/exporter/customers.py:134:    # Customers imported before 2024 have no \
region_code: derive it from the country.
src/exporter/customers.py:137:        record["region"] = legacy
src/exporter/invoice.py:57:    region = customer["region"]
src/exporter/regions.py:15:# have a country but no region_code: their country gives their region.
tests/fixtures/customers.sql:3:-- region_code is NULL for customers imported before 2024 (see Atlas)
tests/test_customers.py:18:    assert load_customer(row)["region"] == "EU-CENTRAL"
tests/test_customers.py:27:    assert load_customer(legacy_row)["region"] == "EU-WEST"
tests/test_invoice.py:115:    # November; it was imported in 2019 from the \
old billing system, without a region_code."""

_CUSTOMERS = '''\
 124 def load_customer(row: Row) -> dict[str, object]:
 125     """A customer record: id, name, currency and region."""
 126     record: dict[str, object] = {
 127         "id": row["id"],
 128         "name": row["name"],
 129         "currency": row["currency"],
 130     }
 131     if row["region_code"] is not None:
 132         record["region"] = row["region_code"]
 133         return record
 134     # Customers imported before 2024 have no region_code: derive it from the country.
 135     legacy = LEGACY_REGIONS.get(row["country"])
 136     if legacy is not None:
 137         record["region"] = legacy
 138         return record
 139     logger.info("customer %s has no region", row["id"])
 140     # The caller decides what a customer without a region means.
 141     return record'''

_REGIONS = """\
  12 DEFAULT_REGION = "EU-WEST"  # for new sign-ups, until sales assigns one
  13
  14 # Customers imported from the old billing system (before 2024, before EU-SOUTH existed)
  15 # have a country but no region_code: their country gives their region.
  16 LEGACY_REGIONS = {
  17     "BE": "EU-WEST",
  18     "FR": "EU-WEST",
  19     "IE": "EU-WEST",
  20     "LU": "EU-WEST",
  21     "NL": "EU-WEST",
  22     "AT": "EU-CENTRAL",
  23     "CZ": "EU-CENTRAL",
  24     "DE": "EU-CENTRAL",
  25     "PL": "EU-CENTRAL",
  26     "DK": "NORDICS",
  27     "FI": "NORDICS",
  28     "NO": "NORDICS",
  29     "SE": "NORDICS",
  30     "GB": "UK",
  31 }"""

_FAILED = """\
============================= test session starts ==============================
collected 14 items

tests/test_invoice.py .............F                                      [100%]

=================================== FAILURES ===================================
________________________ test_invoice_for_legacy_customer ______________________

    def test_invoice_for_legacy_customer(db):
        # Reproduces the export failure of 2026-12-01: customer 4411 (IT) came back in
        # November; it was imported in 2019 from the old billing system, without a region_code.
        customer = load_customer(db.row(customer_id=4411))
>       invoice = build_invoice(customer, date(2026, 11, 30))

tests/test_invoice.py:117:
_ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _
src/exporter/invoice.py:57: in build_invoice
    region = customer["region"]
E   KeyError: 'region'
------------------------------ Captured log call -------------------------------
INFO     exporter.customers:customers.py:139 customer 4411 has no region
=========================== short test summary info ============================
FAILED tests/test_invoice.py::test_invoice_for_legacy_customer - KeyError: 'region'
========================= 1 failed, 13 passed in 0.84s ========================="""

_TEST_SOURCE = """\
 113 def test_invoice_for_legacy_customer(db):
 114     # Reproduces the export failure of 2026-12-01: customer 4411 (IT) came back in
 115     # November; it was imported in 2019 from the old billing system, without a region_code.
 116     customer = load_customer(db.row(customer_id=4411))
 117     invoice = build_invoice(customer, date(2026, 11, 30))
 118     assert invoice.region == "EU-SOUTH"
 119     assert invoice.currency == "EUR"
 120     assert len(invoice.lines) == 3"""

_PATCH = """\
--- a/src/exporter/regions.py
+++ b/src/exporter/regions.py
@@ -28,4 +28,7 @@ LEGACY_REGIONS = {
     "NO": "NORDICS",
     "SE": "NORDICS",
     "GB": "UK",
+    "ES": "EU-SOUTH",
+    "IT": "EU-SOUTH",
+    "PT": "EU-SOUTH",
 }
--- a/src/exporter/customers.py
+++ b/src/exporter/customers.py
@@ -136,6 +136,5 @@ def load_customer(row: Row) -> dict[str, object]:
     if legacy is not None:
         record["region"] = legacy
         return record
-    logger.info("customer %s has no region", row["id"])
-    # The caller decides what a customer without a region means.
-    return record
+    # Refuse here, naming the customer, rather than fail later with a KeyError.
+    raise ValueError(f"customer {row['id']}: no region for country {row['country']!r}")
--- a/tests/test_customers.py
+++ b/tests/test_customers.py
@@ -27 +27,7 @@ def test_legacy_customer_gets_region_from_country(legacy_row):
     assert load_customer(legacy_row)["region"] == "EU-WEST"
+
+
+def test_legacy_customer_of_an_unmapped_country_is_refused(legacy_row):
+    row = {**legacy_row, "country": "MT"}
+    with pytest.raises(ValueError, match="no region for country 'MT'"):
+        load_customer(row)
"""

_PATCHED = """\
Applied 3 files: src/exporter/regions.py (1 hunk, +3), src/exporter/customers.py (1 hunk, \
+2 -3), tests/test_customers.py (1 hunk, +6)."""

_PASSED = """\
============================= test session starts ==============================
collected 52 items

tests/test_currency.py .......                                            [ 13%]
tests/test_customers.py .........                                         [ 30%]
tests/test_invoice.py ..............                                      [ 57%]
tests/test_regions.py .....                                               [ 67%]
tests/test_taxes.py .................                                     [100%]

============================== 52 passed in 2.31s =============================="""


def _call(tool: str, **arguments: object) -> str:
    """A tool call as the agent writes it: JSON on one line."""
    return json.dumps({"tool": tool, "arguments": arguments})


# The agent's steps after its first turn: the tool it called and what the tool returned.
AGENT_STEPS = (
    (_call("list_files", path="."), _LISTING),
    (_call("search", query=r'region_code|\["region"\]', path="src tests"), _SEARCH),
    (_call("read_file", path="src/exporter/customers.py", start=124, end=141), _CUSTOMERS),
    (_call("read_file", path="src/exporter/regions.py", start=12, end=31), _REGIONS),
    (_call("run_tests", path="tests/test_invoice.py"), _FAILED),
    (_call("read_file", path="tests/test_invoice.py", start=113, end=120), _TEST_SOURCE),
    (_call("apply_patch", diff=_PATCH), _PATCHED),
    (_call("run_tests", path="tests"), _PASSED),
)
