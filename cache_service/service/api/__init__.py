"""The HTTP API: `create_app` builds the FastAPI application."""

from cache_service.service.api.app import create_app

__all__ = ["create_app"]
