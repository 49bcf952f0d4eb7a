"""`telemetry`: how the proxy names itself in traces, and whether spans carry content."""

from __future__ import annotations

from proxy.config.model import ConfigModel


class TelemetryConfig(ConfigModel):
    service_name: str = "loopwarden"
    capture_content: bool = False
