"""kvbus's version, in a module of its own so that any layer may say it (a publisher
stamps it on `SourceStarted`) without importing the package's front door."""

__version__ = "0.2.0"
