"""Errors a user acts on: each message names the key, file or resource and the value.

The CLI prints these as one line (no traceback). Depends on nothing in streamrl.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid or inconsistent setting; the message names the key and the value."""
