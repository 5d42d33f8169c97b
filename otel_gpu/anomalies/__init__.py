"""Watching calls as they run: the stuck-call watchdog."""
