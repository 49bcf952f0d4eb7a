"""Telemetry: spans and metrics as observers of the engine's events, plus the HTTP layer's own."""
