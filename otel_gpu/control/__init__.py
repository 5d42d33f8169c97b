"""Live control: turn a running process's recording up and down without a restart (docs/control.md)."""
