"""The Gradio app: the page, its tabs and their handlers, and the pure HTML and charts they show."""
