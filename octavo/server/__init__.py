"""The OpenAI-compatible HTTP server: FastAPI app, protocol models, metrics (see app.py).

Nothing is imported here: `octavo.cli` imports `octavo.server.args` for every command.
"""
