"""Errors a user acts on: each message names the key, file or resource and the value.

The CLI prints these as one line (no traceback). Depends on nothing in streamrl.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid or inconsistent setting; the message names the key and the value."""


class RunStopped(RuntimeError):
    """A run that cannot go on (e.g. a replica dead for good); the message names the part and
    the cause. The CLI prints it as one line and exits 3."""
