"""The `embedfleet` command: composes the producer's and the worker's verbs, and the demo."""
