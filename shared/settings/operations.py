"""Operations settings: the worker's health port, its shutdown, and the logs."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from embedfleet.shared.settings.section import Section


class OperationsSettings(Section):
    """What an operator watches and signals: health and metrics, drain on SIGTERM, logs."""

    title: ClassVar[str] = "Operations: health, shutdown and logs"

    health_port: int = Field(default=0, ge=0, le=65535)
    """Port of the worker's /healthz, /readyz and /metrics (0 = off)."""
    drain_timeout_s: float = Field(default=60.0, gt=0)
    """On SIGTERM: seconds to finish in-flight work before exit."""
    log_format: Literal["auto", "json", "console"] = "auto"
    """`auto`: console on a TTY, JSON otherwise."""
    log_level: str = "info"
    """debug, info, warning or error. Other libraries' warnings (transformers, torch, Python's
    `warnings`) show only at debug (`embedfleet --verbose`)."""
