"""The HTTP front end's own settings (:class:`AppConfig`), frozen and checked when made, and the dependency through
which a route reads them (``config: ConfigDep``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

__all__ = ["AppConfig", "ConfigDep", "get_app_config"]


@dataclass(frozen=True)
class AppConfig:
    api_key: str | None = None
    """Bearer token every route but ``/health`` requires; ``None``: no authentication."""
    max_body_bytes: int = 64 * 1024
    """Largest request body without media; larger ones get 413."""
    max_upload_bytes: int = 32 * 2**20
    """Largest uploaded media file (or data URL's content); a body may be this much larger (twice: base64)."""
    cors_origins: tuple[str, ...] = ()
    """Origins allowed by CORS; empty: no CORS headers at all."""
    live_max_seconds: float = 600.0
    """The longest live video (``"live": true``) a request or its directions may ask for, in seconds."""

    def __post_init__(self) -> None:
        if self.api_key is not None and len(self.api_key) < 8:
            raise ValueError("api_key is shorter than 8 characters; use a long random token")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes={self.max_body_bytes} must be >= 1024")
        if not self.live_max_seconds > 0:
            raise ValueError(f"live_max_seconds={self.live_max_seconds} must be > 0")
        if self.max_upload_bytes < 1024:
            raise ValueError(f"max_upload_bytes={self.max_upload_bytes} must be >= 1024")


def get_app_config(request: Request) -> AppConfig:
    """The app's config (``app.state.config``, set by :func:`server.http.app.create_app`)."""
    return request.app.state.config


ConfigDep = Annotated[AppConfig, Depends(get_app_config)]
"""A route parameter annotated ``config: ConfigDep`` receives the app's config."""
