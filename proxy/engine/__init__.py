"""The tool loop, pure: it decides, the adapters act (no HTTP, web framework or telemetry)."""
