"""Worker processes: the child, its frame reader, the supervisor that owns them, the pool."""
