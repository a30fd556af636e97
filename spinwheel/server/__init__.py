"""OpenAI-compatible HTTP serving on the engine."""

from spinwheel.server.app import OpenAIServer
from spinwheel.server.serve import BackgroundServer, ServeConfig, build_server, serve

__all__ = ["OpenAIServer", "BackgroundServer", "ServeConfig", "build_server", "serve"]
