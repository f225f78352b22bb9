"""Engines' KV events over ZMQ: their configuration and the subscriber feeding the views."""
