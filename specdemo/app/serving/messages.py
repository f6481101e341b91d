"""What a person reads when the app refuses or fails something: one sentence, escaped."""

from __future__ import annotations

import html

import gradio as gr


def user_error(message: str, log: bool = False) -> gr.Error:
    """Gradio shows an error's message as HTML, and ours may quote what the user typed: escape it."""
    return gr.Error(html.escape(message, quote=False), print_exception=log)
