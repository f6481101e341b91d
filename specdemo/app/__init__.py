"""The Gradio app: page.py composes the tabs (tabs/), the lessons row and the step view (panels/), the server side of
runs (serving/) and the pure pictures of a run (views/); form.py is the one settings table."""
