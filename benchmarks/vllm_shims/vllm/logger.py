"""`init_logger` with vLLM's `*_once` methods (each message is logged the first time only)."""

from __future__ import annotations

import logging


class _OnceLogger(logging.LoggerAdapter):
    _seen: set[tuple[int, str]] = set()

    def _once(self, level: int, msg: str, *args) -> None:
        if (level, msg) not in self._seen:
            self._seen.add((level, msg))
            self.log(level, msg, *args)

    def debug_once(self, msg: str, *args, **_) -> None:
        self._once(logging.DEBUG, msg, *args)

    def info_once(self, msg: str, *args, **_) -> None:
        self._once(logging.INFO, msg, *args)

    def warning_once(self, msg: str, *args, **_) -> None:
        self._once(logging.WARNING, msg, *args)


def init_logger(name: str) -> _OnceLogger:
    return _OnceLogger(logging.getLogger(name), {})
