"""OpenAI-compatible HTTP server: build_app(engine, ServerConfig) -> FastAPI app (run it with uvicorn)."""
from kvforge.server.app import ServerConfig, build_app

__all__ = ["ServerConfig", "build_app"]
