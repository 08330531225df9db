"""Profiling: what the runtime recorded (runtime/events.py) as a Chrome/Perfetto trace."""
