"""The one exception a setting that cannot work raises, in a leaf of its own: every config
validates itself with it (engines' included, which import nothing of the mesh), and the mesh's
config_error.py turns it into one line and an exit status."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting that cannot work; the message is one line and names the flag."""
