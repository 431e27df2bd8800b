"""loramux-s3: a loramux plugin resolving LoRA adapters from S3 (see README.md)."""

from __future__ import annotations

import os

import loramux
from loramux_s3.resolver import DEFAULT_MAX_BYTES, MAX_BYTES_ENV, URI_ENV, S3Resolver

__all__ = ["S3Resolver", "register_resolvers"]


@loramux.hookimpl
def register_resolvers(register, settings):
    max_bytes = os.environ.get(MAX_BYTES_ENV)
    register(
        S3Resolver(
            os.environ.get(URI_ENV) or None,
            max_bytes=int(max_bytes) if max_bytes else DEFAULT_MAX_BYTES,
            timeout=settings.fetch_timeout,
        )
    )
