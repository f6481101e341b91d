"""Hugging Face Space entry point: `python app.py` (or `gradio app.py` for reload mode)."""

try:  # On a ZeroGPU Space, `spaces` must be imported before anything initialises CUDA.
    import spaces  # noqa: F401
except ImportError:
    pass

from specdemo.app.page import build_demo

demo = build_demo()

if __name__ == "__main__":
    demo.launch()
