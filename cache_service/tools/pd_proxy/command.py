"""`cache-service pd-proxy`: the subcommand's parser, and its run (`serving.py` serves)."""

from __future__ import annotations

import argparse
import sys

from cache_service.tools.pd_proxy.options import add_arguments, options_from_args


def add_pd_proxy_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The `pd-proxy` subcommand."""
    parser = commands.add_parser(
        "pd-proxy",
        help="an OpenAI-compatible proxy over prefill and decode vLLM engines sharing KV "
        "through the cache",
        description="Send each completion request to a prefill engine (one token, its KV "
        "stored in the cache) and then to a decode engine with the prefill's kv_transfer_params "
        "(its KV loaded from the cache). With --cache, the engines holding the longest prefix "
        "of the prompt are chosen (POST /v1/route); otherwise those with fewest requests in "
        "flight. A failed prefill engine costs only speed: the decode engine computes alone.",
    )
    add_arguments(parser)


def run_pd_proxy_command(args: argparse.Namespace) -> int:
    """Run the proxy until a signal; 0 after a clean stop, 2 on options that cannot work."""
    try:
        options = options_from_args(args)
    except ValueError as exc:
        print(f"cache-service pd-proxy: {exc}", file=sys.stderr)
        return 2
    # Imported here so that --help and refusals answer without loading the server.
    from cache_service.tools.pd_proxy.serving import serve  # noqa: PLC0415

    return serve(options)
