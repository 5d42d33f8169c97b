"""The crash journal: its writer (the observer) and ``otel-gpu recover``, its reader."""
