"""triclip app: the CLI (``triclip.app.cli``) and the search page (``triclip.app.gradio_app``, assembled from its rooms).

The settings below are Gradio's, read when gradio is imported: they are set here, before any
module of this package can import it (``triclip.app.gradio_patches`` holds the rest of what depends
on the Gradio version).
"""

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # read when gradio is imported: no telemetry
# Gradio's queue rebuilds a pandas summary of its last GRADIO_ANALYTICS_MAX_EVENTS (10,000) events after
# every event (for its monitoring page, never sent anywhere): under load that was most of the server's
# event-loop time. Summarise the last 200, every 100 events.
os.environ.setdefault("GRADIO_ANALYTICS_MAX_EVENTS", "200")
os.environ.setdefault("GRADIO_ANALYTICS_CACHE_FREQUENCY", "100")
# Gradio asks matplotlib for its backend around every event (and switches to agg); with the backend left to
# auto-detection that lookup cost 1-2% of the server's CPU under load. The app draws its two figures once, at start.
os.environ.setdefault("MPLBACKEND", "agg")
