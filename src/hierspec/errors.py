"""Exceptions raised by hierspec.

Every error a user can cause derives from :class:`HierspecError`, so the CLI and the server can report the message
without a traceback.
"""

from __future__ import annotations


class HierspecError(Exception):
    """Base class for errors caused by input, configuration or files rather than by a bug."""


class InputError(HierspecError, ValueError):
    """A prompt, parameter or option is invalid."""


class ModelLoadError(HierspecError):
    """A model or tokenizer could not be found, read or used."""
