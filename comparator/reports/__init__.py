"""Renderers of results: terminal text, Markdown, CSV/Parquet, HTML and plots (never torch)."""
