"""The proxy's own refusals, under the project's one root (`PromptCacheError`), so one handler
in `app.py` answers each as RFC 9457 problem+json.

The proxy's branch of the hierarchy::

    PromptCacheError
    ├── RequestError
    │   └── MalformedBody        400  the body is not JSON, or not a JSON object (core's)
    └── ProxyError               5xx: no engine could answer
        ├── NoDecodeEngine       503  no decode engine is healthy, or every one tried failed
        ├── DecodeFailed         502  D's answer broke off before it was whole
        └── DecodeTimeout        504  D sent nothing for --decode-timeout-seconds

An engine's own answers (its 4xx and 5xx) are not the proxy's: they pass through as sent.
"""

from __future__ import annotations

from cache_service.core.errors import MalformedBody, PromptCacheError

__all__ = ["DecodeFailed", "DecodeTimeout", "MalformedBody", "NoDecodeEngine", "ProxyError"]


class ProxyError(PromptCacheError):
    """No engine could answer the request."""

    status = 502
    problem = "proxy-error"
    title = "Proxy error"


class NoDecodeEngine(ProxyError):
    """No decode engine is healthy, or each one tried could not be reached; `tried` names
    each with its error."""

    status = 503
    problem = "no-decode-engine"
    title = "No decode engine"


class DecodeFailed(ProxyError):
    """The decode engine's answer broke off before it was whole."""

    status = 502
    problem = "decode-failed"
    title = "Decode engine failed"


class DecodeTimeout(ProxyError):
    """The decode engine sent nothing for the decode timeout."""

    status = 504
    problem = "decode-timeout"
    title = "Decode engine timed out"
