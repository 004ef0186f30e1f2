"""``triax serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over
``triax.inference.Server`` (docs/serving.md)."""
