"""Internals of the HTTP server (settings, app factory, routes, errors, auth, admission, metrics, audio encoding).

The top-level `inference_server.py` is the entry point; this package keeps it thin.
"""
