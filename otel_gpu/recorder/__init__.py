"""The flight recorder: the dump format, its target, the recorder and the in-memory ring."""
