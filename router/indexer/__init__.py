"""`kvroute index`: the standalone KV-event indexer writing into Redis, and the writer
lease that keeps it to one writer per namespace."""
