"""The one exception a bad setting raises (its own module so every config module can use it)."""


class ConfigError(ValueError):
    """A setting that cannot work; the message is one line and names the flag."""
