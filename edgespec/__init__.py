"""edgespec: edge-cloud speculative decoding of LLMs.

`from edgespec import EdgeSession` is the app-facing entry point; the import is lazy so that
`edgespec models ...` works before llama.cpp is loaded.
"""
__version__ = "0.1.0"
__all__ = ["EdgeSession", "TreeShape", "__version__"]


def __getattr__(name: str):
    if name == "EdgeSession":
        from edgespec.edge.session import EdgeSession
        return EdgeSession
    if name == "TreeShape":
        from edgespec.edge.drafting import TreeShape
        return TreeShape
    raise AttributeError(name)
