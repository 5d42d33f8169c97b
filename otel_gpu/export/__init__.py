"""From finished calls to spans: the pipeline, its export thread and its observers."""
