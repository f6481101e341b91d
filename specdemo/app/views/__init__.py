"""Pure pictures of a run: token HTML, plotly charts, summaries and per-round sentences, from rounds and records; no
gradio, no server state."""
