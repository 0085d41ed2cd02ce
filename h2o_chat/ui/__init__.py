"""The Gradio web UI: chat, long-story and compare views with a live retention map.

``build_app(provider, config)`` builds the app; the data behind its map and gauges lives
in ``retention`` and ``gauges``, plain functions that need no Gradio.
"""
