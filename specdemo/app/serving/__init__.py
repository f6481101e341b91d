"""The server side of the page: the shared models and runs, long handlers and their stops, downloads, ZeroGPU calls,
the sentences a refusal shows, and shared links."""
