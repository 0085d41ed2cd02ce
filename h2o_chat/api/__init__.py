"""The OpenAI-compatible HTTP API, served beside the web UI on one port.

``server.create_app`` builds the one FastAPI app (API routes, the UI mounted at ``/``)
and ``server.serve`` runs it. Inside: ``schema`` checks a request body, ``turns`` runs
turns (admission, a worker thread per turn on a ``ChatSession``), ``conversations`` keeps
sessions between stateless requests for cache reuse, ``stops`` applies stop strings,
``responses`` shapes OpenAI's objects and server-sent events, ``metrics`` exports
Prometheus metrics, ``routes`` ties them to the endpoints; ``origins`` (Host and Origin)
and ``page_guards`` (login, request sizes) stand in front of every route, the page's too.
"""
