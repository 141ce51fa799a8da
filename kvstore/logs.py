"""The log levels the commands take and the one format their logs share (serve and the two workers)."""

from __future__ import annotations

import logging

LEVELS = ("debug", "info", "warning", "error")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def check_level(text: str) -> str:
    """``text`` when it names one of ``LEVELS`` (any case); ValueError naming them otherwise."""
    if text.lower() not in LEVELS:
        raise ValueError(f"{', '.join(LEVELS[:-1])} or {LEVELS[-1]}; got {text!r}")
    return text


def configure(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=FORMAT)
