"""Loopwarden: an OpenAI-compatible gateway that runs the tool loop on the server."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("loopwarden")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"
