"""`cache-service pd-proxy`: an OpenAI-compatible proxy in front of vLLM engines split into
prefill (P) and decode (D) engines that share KV through the prompt cache.

The proxy never touches KV. Per request it sends P a copy with `max_tokens: 1` and
`kv_transfer_params: {"do_remote_decode": true, ...}`, reads the `kv_transfer_params` P answers
with, and sends D the original request with those params (vLLM's disaggregated proxy pattern).
A P that fails costs only speed: D then computes the whole prompt.

    options    the settings, and the flags that make them
    bodies     the JSON read and sent: the request, P's copy, D's, P's returned params
    engines    the pool: health, requests in flight, the choice of an engine
    health     the background checks of every engine's GET /health
    placement  which engines hold the longest prefix (an engine's /tokenize, the cache's
               /v1/route)
    flow       P, then D, with the fallbacks and failovers
    relay      D's stream passed through, and ended cleanly when it breaks off
    usage      token counts from D's answers (JSON, or a stream's final usage chunk)
    metrics    prompt_cache_pd_proxy_* on a registry of its own
    errors     the proxy's refusals, as problem+json
    reporting  failures worded in one line, warnings at most once per interval
    app        the Starlette app factory; its lifespan owns the HTTP clients and health task
    command    the CLI subcommand; serving runs it with uvicorn
"""
