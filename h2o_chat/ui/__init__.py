"""The Gradio web UI: chat, long-story and compare views with a live retention map.

``h2o_chat.ui.app.build_app(provider, config)`` builds the app. The data behind its map
and gauges lives in ``retention`` and ``gauges``: plain functions, no Gradio needed.
"""
