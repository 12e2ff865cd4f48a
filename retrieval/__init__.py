"""triclip's library: data, models, objectives, metrics and compact features.

This package never imports ``training``, ``index`` or ``app``.
"""
