"""The one error a config refusal raises (every layer above raises it too)."""


class ConfigError(ValueError):
    """A config value is wrong; the message starts with the dotted field name."""
