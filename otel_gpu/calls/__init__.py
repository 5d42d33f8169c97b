"""What happens on the caller's thread: the decorator, the call record, metadata and statistics."""
