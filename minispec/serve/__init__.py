"""An OpenAI-compatible HTTP server on minispec's engine: `python -m minispec.serve --target T`. Starlette and
uvicorn are the optional extra `minispec[serve]`; nothing outside this package imports them."""
