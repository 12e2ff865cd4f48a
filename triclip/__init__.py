"""triclip: train, prune and serve compact CLIP-style image-text retrieval.

The packages, in pipeline order (docs/DESIGN.md): ``core`` (errors, atomic io, progress, distributed),
``data`` (paired sources, splits), ``compact`` (importance order, metrics), ``model`` (towers, the dual
encoder, embedding, runs), ``losses``, ``training``, ``index`` (codes, FAISS indexes, search), ``app``
(the command line, the search page, the demo). Each imports only the packages before it.
"""
