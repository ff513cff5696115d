"""An OpenAI-compatible HTTP server on minispec's engine: `python -m minispec.serve --target T`.

    scheduler.py   one thread holding the models, decoding every request in one continuous batch
    protocol.py    the OpenAI API's request fields and reply shapes
    app.py         the ASGI app (Starlette): endpoints, streaming, errors, disconnects
    __main__.py    the command line (uvicorn)

Starlette and uvicorn are the optional extra `minispec[serve]`; nothing outside this package imports them."""
