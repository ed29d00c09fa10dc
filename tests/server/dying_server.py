"""A kvforge server (tiny model) whose engine loop dies on its first step: `python dying_server.py MODEL_DIR`.
Prints its port, then serves until the loop dies; the exit status is serve_app's."""
import socket
import sys

from kvforge.cli.serve import serve_app
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.server import build_app


def boom(*args, **kwargs):
    raise RuntimeError("engine broken on purpose")


if __name__ == "__main__":
    engine = LLMEngine(EngineConfig(model=sys.argv[1], kv_cache_memory=8 << 20, max_model_len=512))
    engine.step = engine.abort = boom  # the step raises, and so does its error path: the loop dies
    app = build_app(engine)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    sys.exit(serve_app(app, sockets=[sock], log_level="warning"))
